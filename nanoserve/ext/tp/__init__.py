"""An extension, tensor parallelism: LLM(..., tensor_parallel_size=N) splits the model across N processes, one per GPU
(Megatron-LM's scheme: every rank holds 1/N of each projection and of the KV cache's heads, and runs every step).

  layers.py   the sharded layers, which the model asks for in place of the core's whole ones (layers.py's Layers)
  workers.py  the processes: rank 0's handle on the others, and the loop each other rank runs (the runner's Peers)

The core meets it at three named points: EngineConfig checks tensor_parallel_size with check_config; LLM builds its
runner with start_runner when tensor_parallel_size > 1; and that runner holds the Workers as its Peers, through which
it builds the model's layers, sizes the pool and sends each step. A worker rank is `python -m nanoserve.ext.tp` (rank 0
starts them: __main__.py), or the user's own script under torchrun."""

from nanoserve.ext.tp.workers import check_config, start, start_runner

__all__ = ["check_config", "start", "start_runner"]
