"""transformers' Gemma 4 processor on a conversation with videos, in its own process.

transformers' video processor resizes with torchvision, whose published
wheels for torch 2.13 are CUDA builds: beside the CPU torch their C ops do
not load, and importing torchvision then fails where it declares fake
kernels for two of them (``nms``, ``qnms``). The processor uses torchvision's
Python transforms alone, which run on torch's own ops; so this process
declares those two ops' schemas, imports torchvision from the folder it was
installed to (``pip install --no-deps --target DIR torchvision==0.28.0``,
:data:`tests.helpers.TORCHVISION`), kept off the test environment's path
because transformers would import it everywhere, and writes the processor's
output to an ``.npz``.

Usage: ``python -m tests.video_reference TORCHVISION_DIR CHECKPOINT SPEC OUT``,
SPEC a JSON file ``{"text", "images", "videos", "image_processor",
"video_processor", "unified"}`` (the processors' settings; ``unified``: the
12B unified model's processor).
"""

import json
import sys


def main(torchvision_dir: str, checkpoint: str, spec_file: str, out: str) -> None:
  sys.path.insert(0, torchvision_dir)
  import torch

  lib = torch.library.Library("torchvision", "DEF")  # noqa: F841 (kept alive to the end)
  for op in ("nms", "qnms"):
    lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
  import numpy as np
  import torchvision  # noqa: F401 (before transformers looks for it)
  import transformers
  from PIL import Image
  from transformers.video_utils import load_video

  with open(spec_file) as f:
    spec = json.load(f)
  if spec["unified"]:
    from transformers.models.gemma4_unified import (
      feature_extraction_gemma4_unified as audio,
    )
    from transformers.models.gemma4_unified import (
      image_processing_gemma4_unified as image,
    )
    from transformers.models.gemma4_unified import (
      video_processing_gemma4_unified as video,
    )

    processor_class = transformers.Gemma4UnifiedProcessor
    extractor = audio.Gemma4UnifiedAudioFeatureExtractor
    image_class, video_class = image.Gemma4UnifiedImageProcessor, video.Gemma4UnifiedVideoProcessor
  else:
    from transformers.models.gemma4 import (
      feature_extraction_gemma4 as audio,
    )
    from transformers.models.gemma4 import (
      image_processing_pil_gemma4 as image,
    )
    from transformers.models.gemma4 import (
      video_processing_gemma4 as video,
    )

    processor_class = transformers.Gemma4Processor
    extractor = audio.Gemma4AudioFeatureExtractor
    image_class, video_class = image.Gemma4ImageProcessorPil, video.Gemma4VideoProcessor
  videos = video_class(**spec["video_processor"])
  # The processor's own sampling, through load_video's default backend (PyAV).
  loaded = [
    load_video(p, backend="pyav", sample_indices_fn=videos.sample_frames) for p in spec["videos"]
  ]
  tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
  processor = processor_class(
    feature_extractor=extractor(),
    image_processor=image_class(**spec["image_processor"]),
    tokenizer=tokenizer,
    video_processor=videos,
  )
  images = [Image.open(p).convert("RGB") for p in spec["images"]] or None
  got = processor(
    text=spec["text"],
    images=images,
    videos=[v for v, _ in loaded],
    video_metadata=[m for _, m in loaded],
    do_sample_frames=False,
    return_tensors="np",
  )
  np.savez(
    out,
    **{k: np.asarray(v) for k, v in got.items() if k != "video_metadata"},
    timestamps=np.concatenate([m.timestamps for _, m in loaded]),
  )


if __name__ == "__main__":
  main(*sys.argv[1:])
