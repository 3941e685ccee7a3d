"""The data layer: what becomes a batch of token streams before it is sharded.

It may import the core (:mod:`cpjax.parallel`, :mod:`cpjax.masks`,
:mod:`cpjax.batch`, :mod:`cpjax.attention`) and nothing above
it: the models, the training layer and the command line import it.

* :mod:`~cpjax.data.synthetic`: packed, padded, multimodal rows with a
  learnable signal, for ``cpjax train``'s default run and the tests
  (:func:`synthetic_batch`, re-exported here).
* :mod:`~cpjax.data.tokenizer`: a checkpoint's ``tokenizer.json`` and chat
  template, in transformers' sandbox.
* :mod:`~cpjax.data.images`: images resized and patched as Gemma 4's processor does.
* :mod:`~cpjax.data.audio`: audio clips as Gemma 4's feature extractors make
  them (log-mel frames for E2B and E4B, waveform frames for 12B).
* :mod:`~cpjax.data.records`: JSONL (text, chat, images, audio) to documents.
* :mod:`~cpjax.data.corpus`: documents on disk (array_record) packed into rows with grain.

>>> from cpjax import data
>>> data.synthetic_batch is data.synthetic.synthetic_batch
True
"""

from cpjax.data import synthetic as synthetic
from cpjax.data.synthetic import synthetic_batch as synthetic_batch
