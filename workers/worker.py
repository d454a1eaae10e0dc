"""`Worker`: one tensor-parallel rank. Owns the device, the model shard and its part of the paged KV pool.

Lifecycle (the same in-process and inside a Ray actor):
    init_device() -> load_model() -> determine_num_blocks() -> init_kv_cache(n, n_host) -> execute_model(...) * N
Each start-up call records its phases in `startup` (engine/startup.py): device, weights, kv_profile, kv_alloc,
cuda_graphs, warm_up.
"""

from __future__ import annotations

import gc
import logging

import torch

from engine import envs
from engine.config import EngineConfig, resolve_device, resolve_dtype
from engine.executor import Executor, ExecutorError, StepHandle
from engine.outputs import DraftAsk, GrammarBitmask, ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.spec_decode import may_run_ahead
from engine.startup import StartupTimes
from kernels._triton import KernelSettings, references_forced
from kernels._triton import configure as configure_kernels
from kernels.fp8 import FP8_DTYPE
from kernels.rejection_sampler import warm_up_rejection
from kernels.run_ahead import warm_up_run_ahead
from workers import parallel
from workers.compile import compile_model
from workers.draft_runner import DraftRunner
from workers.grammar_mask import warm_up_grammar_mask
from workers.kv_pool import (
    HostKVPool,
    KVMoveError,
    allocate_kv_caches,
    num_blocks_cpu,
    num_blocks_gpu,
    num_host_blocks,
)
from workers.kv_scales import attention_layers, calibrate_kv_scales
from workers.lora import LoRAManager
from workers.model_runner import ModelRunner
from workers.sampler import warm_up_sampler
from workers.weights import load_model

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 dist_init_method: str | None = None, device_index: int | None = None):
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.dist_init_method = dist_init_method
        self.device_index = device_index
        self.device_kind = resolve_device(config.parallel.device)
        self.dtype = TORCH_DTYPES[resolve_dtype(config.model.dtype, self.device_kind, config.model.hf_config)]
        self.kv_dtype = FP8_DTYPE if config.cache.kv_cache_dtype == "fp8" else self.dtype
        self.model = None
        self.lora: LoRAManager | None = None  # adapter slots, with enable_lora
        self.runner: ModelRunner | None = None
        self.draft_model = None  # speculative decoding's draft model (method "draft_model"), beside the target
        self.draft: DraftRunner | None = None
        self.decode_step_s: float | None = None  # a batch-1 decode graph's replay, timed at start-up (CUDA graphs)
        self.startup = StartupTimes()
        configure_kernels(kernel_settings())

    def init_device(self) -> None:
        with self.startup.phase("device"):
            self._init_device()

    def _init_device(self) -> None:
        if self.device_kind == "cuda":
            index = self.device_index if self.device_index is not None else 0
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        parallel.init_parallel(self.rank, self.world_size, backend, self.dist_init_method)
        if self.device_kind == "cuda" and parallel.init_symmetric_all_reduce(self.dtype, self.device):
            logger.info("rank %d: all-reduce %s", self.rank, parallel.all_reduce_backend())
        torch.manual_seed(self.config.model.seed)

    def load_model(self) -> None:
        model_config = self.config.model
        with self.startup.phase("weights"):
            self.model = load_model(model_config.hf_config, model_config.model, self.dtype, self.device,
                                    model_config.load_format, model_config.seed, model_config.max_model_len,
                                    model_config.quant_config)
            draft = self._draft_model_config()
            if draft is not None:  # before the KV profile: its weights take their memory first
                self.draft_model = load_model(draft.hf_config, draft.model, self.dtype, self.device, draft.load_format,
                                              draft.seed, draft.max_model_len, draft.quant_config)
            if self.config.lora is not None:  # before the KV profile: the slots take their memory first
                self.lora = LoRAManager(self.model, self.config.lora, model_config.hf_config, self.dtype, self.device)
        if self.kv_dtype == FP8_DTYPE:
            with self.startup.phase("kv_scales"):
                scales = calibrate_kv_scales(self.model, self.device, self.dtype,
                                             model_config.hf_config.get("bos_token_id"))
            logger.info("rank %d: KV cache in float8_e4m3fn, per-head scales %s .. %s (K), %s .. %s (V)", self.rank,
                        *_scale_range(k for k, _ in scales), *_scale_range(v for _, v in scales))
        if self.config.compilation.level == 3:  # after the KV calibration, which runs the layers eagerly
            compile_model(self.model)

    def _draft_model_config(self):
        spec = self.config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        assert spec.draft_model_config is not None, "create_engine_config reads the draft model's checkpoint"
        return spec.draft_model_config

    @property
    def ngram_lookup(self) -> tuple[int, int] | None:
        """(prompt_lookup_min, prompt_lookup_max) of n-gram speculation, whose drafts the runner can propose on the
        device (kernels/ngram.py); None without it, or with PAGODA_SPEC_RUN_AHEAD=0 (the driver proposes
        every draft, and the runner keeps no token histories for the lookup)."""
        spec = self.config.speculative
        if spec is None or spec.method != "ngram" or not may_run_ahead():
            return None
        return spec.prompt_lookup_min, spec.prompt_lookup_max

    @property
    def block_bytes(self) -> int:
        return self.model.kv_layout.bytes_per_block(self.config.cache.block_size, self.kv_dtype)

    @property
    def draft_block_bytes(self) -> int:
        """A block of the draft's pool (as many blocks as the target's, in the model dtype); 0 without a draft."""
        if self.draft_model is None:
            return 0
        return self.draft_model.kv_layout.bytes_per_block(self.config.cache.block_size, self.dtype)

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit on this rank (the executor takes the minimum over ranks). A draft model's pool
        has as many blocks as the target's: each block's bytes count both."""
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if self.device_kind == "cpu":
            return num_blocks_cpu(cache.cpu_kv_cache_bytes, self.block_bytes + self.draft_block_bytes)
        with self.startup.phase("kv_profile"):
            self._profile_run()
            return num_blocks_gpu(self.device, cache.gpu_memory_utilization, self.block_bytes + self.draft_block_bytes)

    def determine_num_host_blocks(self) -> int:
        """How many blocks the host tier holds on this rank (the executor takes the minimum over ranks)."""
        return num_host_blocks(self.config.cache, self.block_bytes)

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """A forward at the largest step the scheduler can send (and its logits), to measure peak activations."""
        from engine.sampling_params import SamplingParams

        sched_config, block_size = self.config.scheduler, self.config.cache.block_size
        num_tokens = min(sched_config.max_num_batched_tokens, sched_config.max_model_len)
        num_seqs = max(min(sched_config.max_num_seqs, num_tokens), 1)
        per_seq = num_tokens // num_seqs
        blocks_per_seq = -(-per_seq // block_size)
        caches = allocate_kv_caches(self.model.kv_layout, num_seqs * blocks_per_seq, block_size, self.kv_dtype,
                                    self.device)
        runner = ModelRunner(self.model, caches, block_size, self.device, sched_config, is_driver=self.rank == 0,
                             ngram=self.ngram_lookup)  # (its token histories count)
        sched = SchedulerOutput()
        for i in range(num_seqs):
            block_ids = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            sched.new_reqs.append(NewRequestData(f"profile-{i}", [1] * per_seq, [], SamplingParams(), block_ids, 0))
            sched.num_scheduled_tokens[f"profile-{i}"] = per_seq
        torch.cuda.reset_peak_memory_stats(self.device)
        runner.execute_model(sched)
        del runner, caches
        torch.cuda.synchronize(self.device)

    def init_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """The device pool of num_blocks and, when num_host_blocks > 0, the host tier behind it."""
        with self.startup.phase("kv_alloc"):
            caches = allocate_kv_caches(self.model.kv_layout, num_blocks, self.config.cache.block_size,
                                        self.kv_dtype, self.device)
            host_pool = HostKVPool(caches, num_host_blocks) if num_host_blocks > 0 else None
        spec = self.config.speculative
        with self.startup.phase("cuda_graphs"):  # the runner captures the decode (and verify) graphs as it is built
            self.runner = ModelRunner(self.model, caches, self.config.cache.block_size, self.device,
                                      self.config.scheduler, is_driver=self.rank == 0,
                                      use_cuda_graphs=self.use_cuda_graphs, host_pool=host_pool,
                                      lora=self.lora, spec_tokens=spec.num_speculative_tokens if spec else 0,
                                      ngram=self.ngram_lookup)
        if self.draft_model is not None:
            self._init_draft(num_blocks)
        logger.info("rank %d: %d KV blocks of %d tokens (%.2f GiB, %s)", self.rank, num_blocks,
                    self.config.cache.block_size, num_blocks * self.block_bytes / 2**30, self.kv_dtype)
        if host_pool is not None:  # the operator's memory: say how much
            logger.info("rank %d: host KV tier of %d blocks (%.2f GiB of %s host memory)", self.rank,
                        num_host_blocks, host_pool.num_bytes / 2**30, "pinned" if host_pool.is_pinned else "plain")
        if self.device_kind == "cuda":
            with self.startup.phase("warm_up"):
                self._warm_up_prefill(num_blocks)
                if self.rank == 0:  # the rank that samples
                    warm_up_grammar_mask(self.model.vocab_size, self.device)
                    warm_up_sampler(self.model.vocab_size, self.device)
                    if spec is not None:
                        warm_up_rejection(self.model.vocab_size, self.device, self.draft_model is not None)
                warm_up_run_ahead(self.device, self.runner.history is not None, self.ngram_lookup,
                                  spec.num_speculative_tokens if spec else 0)
                if self.runner.graphs is not None and self.ngram_lookup is not None:  # what n-gram speculation's
                    self.decode_step_s = self.runner.graphs.time_decode()  # way goes by; every rank (all-reduces)

    @property
    def use_cuda_graphs(self) -> bool:
        return not (self.config.parallel.enforce_eager or references_forced())

    def _init_draft(self, num_blocks: int) -> None:
        """The draft model's runner and its own KV pool (num_blocks blocks in the model dtype)."""
        with self.startup.phase("kv_alloc"):
            caches = allocate_kv_caches(self.draft_model.kv_layout, num_blocks, self.config.cache.block_size,
                                        self.dtype, self.device)
        with self.startup.phase("cuda_graphs"):  # the draft's decode graphs
            self.draft = DraftRunner(self.draft_model, caches, num_blocks, self.config.cache.block_size, self.device,
                                     self.config.scheduler, self.config.speculative.num_speculative_tokens,
                                     self.runner, self.use_cuda_graphs)
            self.runner.draft_probs = self.draft.probs  # its sampled drafts' distributions, for the verify
        logger.info("rank %d: draft model %s, %d KV blocks of its own (%.2f GiB)", self.rank,
                    self.config.speculative.model, num_blocks, num_blocks * self.draft_block_bytes / 2**30)

    def propose_drafts(self, ask: DraftAsk) -> dict[str, list[int]]:
        assert self.draft is not None, "no draft model on this worker"
        return self.draft.propose(ask)

    @torch.inference_mode()
    def _warm_up_prefill(self, num_blocks: int) -> None:
        """Compiles the prefill kernel's tile variants now (one per query-length class), not while the first
        requests wait. The dummy sequences write into KV blocks that nobody owns yet, then leave."""
        from engine.sampling_params import SamplingParams

        block_size, sched_config = self.config.cache.block_size, self.config.scheduler
        limit = min(sched_config.max_num_batched_tokens, sched_config.max_model_len - 1)
        lengths = {min(1 << i, limit) for i in range(1, 12)}  # 2 .. 2048: every tile size the chunk length picks
        for length in sorted(lengths, reverse=True):
            num_blocks_needed = -(-length // block_size)
            if length < 2 or num_blocks_needed > num_blocks:
                continue
            req_id = f"warm-up-{length}"
            sched = SchedulerOutput(new_reqs=[NewRequestData(req_id, [1] * length, [], SamplingParams(max_tokens=1),
                                                             list(range(num_blocks_needed)), 0)],
                                    num_scheduled_tokens={req_id: length})
            self.runner.execute_model(sched)
            self.runner.update_states(SchedulerOutput(finished_req_ids=[req_id]))
        if self.config.compilation.level == 3 and num_blocks >= 2:  # a compiled model's prefill of several
            # sequences is a graph of its own (one sequence's sizes of 1 are specialized): compiled now too
            reqs = [NewRequestData(f"warm-up-pair-{i}", [1, 1], [], SamplingParams(max_tokens=1), [i], 0)
                    for i in range(2)]
            self.runner.execute_model(SchedulerOutput(new_reqs=reqs, num_scheduled_tokens={r.req_id: 2 for r in reqs}))
            self.runner.update_states(SchedulerOutput(finished_req_ids=[r.req_id for r in reqs]))
        torch.cuda.synchronize(self.device)

    def device_stats(self) -> tuple[int, float]:
        """(bytes in use on this rank's device, its utilization 0..1); (0, 0.0) on CPU."""
        if self.device_kind != "cuda":
            return 0, 0.0
        free, total = torch.cuda.mem_get_info(self.device)
        try:
            utilization = torch.cuda.utilization(self.device) / 100.0  # needs NVML (nvidia-ml-py)
        except Exception:  # noqa: BLE001 - no NVML: memory only
            utilization = 0.0
        return total - free, utilization

    def describe(self) -> dict:
        return {"rank": self.rank, "device": str(self.device), "all_reduce": parallel.all_reduce_backend(),
                "cuda_graphs": bool(self.runner is not None and self.runner.graphs is not None),
                "verify_graph_replays": self.runner.graphs.num_verify_replays  # speculative steps run by a graph
                if self.runner is not None and self.runner.graphs is not None else 0,
                "draft_graph_replays": self.draft.graphs.num_replays  # the draft model's decode passes, likewise
                if self.draft is not None and self.draft.graphs is not None else 0,
                "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
                "kv_scales": [(k.tolist(), v.tolist()) for k, v in
                              ((a.k_scale, a.v_scale) for a in attention_layers(self.model))]
                if self.kv_dtype == FP8_DTYPE and self.model is not None else None}

    def take_lora_reads(self) -> dict[int, str | None]:
        """This rank's adapter reads finished since the last call (workers/lora.py LoRAManager.take_reads)."""
        return self.lora.take_reads() if self.lora is not None else {}

    def check_integrity(self, block_tables: dict[str, list[int]] | None = None) -> None:
        """The draft model's books, and the runner's block tables against the driver's (Executor.check_integrity)."""
        if self.draft is not None:
            self.draft.check_integrity()
        if self.runner is not None and block_tables:
            self.runner.check_block_tables(block_tables)

    def shutdown(self) -> None:
        """Leaves the process group and gives the GPU memory back: weights, KV pool, graphs, adapters. A process
        that starts a second engine after this one (a notebook, a test) sizes its pool from the memory free then."""
        if self.lora is not None:
            self.lora.shutdown()
        self.runner = self.model = self.draft = self.draft_model = self.lora = None
        parallel.destroy_parallel()
        if self.device.type == "cuda":
            gc.collect()  # the model's modules and the graphs hold each other in cycles
            torch.cuda.empty_cache()


class InProcessExecutor(Executor):
    """A single rank in the engine's own process: no actor call per step."""

    supports_overlap = True
    supports_deferred_sampling = True

    def __init__(self, config: EngineConfig):
        if resolve_device(config.parallel.device) == "cpu":
            torch.set_num_threads(envs.get("PAGODA_TORCH_THREADS"))
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()
        self.num_kv_blocks = self.worker.determine_num_blocks()
        self.num_host_kv_blocks = self.worker.determine_num_host_blocks()
        self.worker.init_kv_cache(self.num_kv_blocks, self.num_host_kv_blocks)
        self.kv_block_bytes = self.worker.block_bytes
        self.decode_step_s = self.worker.decode_step_s

    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        return StepHandle(_as_executor_error(self.worker.runner.execute_model_async, scheduler_output, True))

    def awaiting(self, handle: StepHandle) -> dict[str, list[int]]:
        return handle.payload.awaiting_drafts()

    def sample(self, handle: StepHandle, bitmask: GrammarBitmask) -> None:
        _as_executor_error(handle.payload.sample, bitmask)

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        return _as_executor_error(handle.payload.result)

    def take_lora_reads(self) -> dict[int, str | None]:
        return self.worker.take_lora_reads()

    def propose_drafts(self, ask: DraftAsk) -> dict[str, list[int]]:
        return _as_executor_error(self.worker.propose_drafts, ask)

    def check_integrity(self, block_tables: dict[str, list[int]] | None = None) -> None:
        self.worker.check_integrity(block_tables)

    def device_stats(self) -> tuple[int, float]:
        return self.worker.device_stats()

    def describe(self) -> list[dict]:
        return [self.worker.describe()]

    def startup_phases(self) -> dict[str, float]:
        return dict(self.worker.startup.phases)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


def kernel_settings() -> KernelSettings:
    """The kernels' settings from the environment (`PAGODA_KERNELS=ref`, `PAGODA_PDL`)."""
    return KernelSettings(force_references=envs.get("PAGODA_KERNELS").lower() == "ref", pdl=envs.get("PAGODA_PDL"))


def _scale_range(scales) -> tuple[float, float]:
    values = torch.cat([s.flatten().float().cpu() for s in scales])
    return values.min().item(), values.max().item()


def _as_executor_error(fn, *args):
    """Runs a step's launch or wait; a failure becomes an ExecutorError that fails the step's requests (a failed KV
    move: every request, and the executor stops)."""
    try:
        return fn(*args)
    except Exception as e:
        logger.exception("step failed")
        raise ExecutorError(f"{type(e).__name__}: {e}", is_fatal=isinstance(e, KVMoveError)) from e
