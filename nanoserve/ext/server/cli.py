"""The `nanoserve` console command, in vLLM's style: `nanoserve serve [MODEL] --port 8000 --api-key KEY`. It owns only
the command's shape; the flags are those of `python -m nanoserve.ext.server` (app.py's main) (every EngineConfig and
ServerConfig field: --max-model-len, --gpu-memory-utilization, --tensor-parallel-size, --max-num-seqs,
--enable-prefix-caching and --no-enable-prefix-caching, ...), which `nanoserve serve --help` lists."""

import sys

from nanoserve.ext.server import app

USAGE = "usage: nanoserve serve [MODEL] [--host HOST] [--port PORT] [--api-key KEY] ... (nanoserve serve --help)"


def main(argv: list[str] | None = None) -> None:
    """`nanoserve serve MODEL --flags` runs the server as `python -m nanoserve.ext.server --model MODEL --flags`
    would."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "serve":
        raise SystemExit(USAGE)
    flags = args[1:]
    if flags and not flags[0].startswith("-"):  # the model, given first as vLLM's `vllm serve MODEL` takes it
        flags = ["--model", *flags]
    app.main(flags, prog="nanoserve serve")


if __name__ == "__main__":
    main()
