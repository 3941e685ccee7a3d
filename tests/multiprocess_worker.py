"""One process of a 2-process x 4-device CPU cluster (run by test_multiprocess.py).

    python tests/multiprocess_worker.py PORT PROCESS_ID NUM_PROCESSES OUT.npz

Builds one 8-device mesh over both processes, then runs shard_batch and
ring_attention forward and backward, and three training steps on an (fsdp 2,
cp 4) mesh crossing the processes on both axes, with a save and a resume; process 0
saves the (gathered) results for the test to compare with a 1-process run.
"""

import sys


def main():
  port, pid, nproc, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
  import jax

  jax.config.update("jax_num_cpu_devices", 8 // nproc)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=nproc,
    process_id=pid,
    initialization_timeout=120,
  )
  import numpy as np
  from jax.experimental import multihost_utils

  from tests import multiprocess_cases as cases

  results = cases.run_all(jax.make_mesh((8,), ("cp",)))
  results.update(cases.run_fsdp(out_path + ".ckpt"))
  gathered = {
    k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in results.items()
  }
  if pid == 0:
    np.savez(out_path, **gathered)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
