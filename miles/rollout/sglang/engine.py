"""The rollout-engine contract (:class:`miles.rollout.contract.RolloutEngine`) on sglang.

    engine = SglangRolloutEngine.from_config(config, engine_id)   # in-process sglang.Engine, or --sglang-url
    engine.release_memory_occupation()                           # sglang tags weights, kv_cache, cuda_graph
    engine.resume_memory_occupation(["weights"])
    engine.begin_weight_update(v); engine.update_weights_from_tensor(payloads); engine.end_weight_update(v)
    engine.resume_memory_occupation(["kv_cache"])                # kv_cache and cuda_graph
    samples = engine.generate(prompt_ids, SamplingParams(...))

What the client adds to sglang, which checks less than the contract promises:

- The memory states are tracked here: each tag is released or resumed once (sglang is told only about
  tags that change), ``generate`` and weight updates are refused with the contract's errors before
  anything reaches sglang, and release is refused while a ``generate`` runs. sglang reports no sizes:
  release and resume report 0 bytes per tag.
- Weight-update sessions are the client's; from sglang 0.5.21 (:data:`WEIGHT_SESSION_SINCE`) they are also
  opened and closed on sglang (``begin_weight_update`` / ``end_weight_update``), which refuses updates
  outside one. The radix cache is flushed once after a session, before the next ``generate``.
- The engine consumes sglang's own flattened bucket (``weight_payload`` =
  :data:`~miles.rollout.contract.SGLANG_FLATTENED_BUCKET`): the trainer builds it with sglang's class
  (:mod:`miles.weights.push`), and its payloads (one per tensor-parallel rank) pass through to sglang
  untouched; a broadcast is received by sglang into its own bucket. ``(name, tensor)`` pairs
  (``load_format=None``) are packed here (:mod:`miles.rollout.sglang.payloads`).
- ``generate`` sends each of the ``n`` samples of a prompt as its own request (prompt-major), with the
  seed of sample ``k`` = ``seed * 65537 + k`` as sglang's ``sampling_seed`` when the call has a seed;
  ``meta_info.output_token_logprobs`` (``(logprob, token_id, text)`` triples) become the samples'
  ``response_logprobs``.
- Under ``--use-rollout-routing-replay`` (R3) the engine runs with sglang's ``enable_return_routed_experts`` (a
  server at ``--sglang-url`` must have been started with ``--enable-return-routed-experts``), each generate asks
  for ``return_routed_experts``, and ``meta_info.routed_experts`` becomes each sample's routes
  (:mod:`miles.rollout.sglang.routes`); an answer without them fails the call, naming the server flag.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Optional, Sequence, Union

from miles.rollout.contract import (FLATTENED_BUCKET, KV_CACHE, LOAD_FORMATS, SGLANG_FLATTENED_BUCKET, WEIGHTS,
                                    check_memory_tags)
from miles.rollout.engine_state import EngineState, check_prompts
from miles.rollout.sglang import needs_weight_session, parse_server_args, parse_version
from miles.rollout.sglang.routes import RoutedExpertsLayout
from miles.rollout.sglang.transport import HttpSglang, InProcessSglang, SglangCallError
from miles.rollout.types import Sample, SamplingParams
from miles.routing.routes import Routes, RoutesError

logger = logging.getLogger(__name__)

__all__ = ["SglangRolloutEngine", "SGLANG_TAGS", "server_args", "sglang_sampling_params", "samples_from_outputs"]

# The contract's tags and sglang's: "kv_cache" is everything generation holds besides the weights.
SGLANG_TAGS = {WEIGHTS: ("weights",), KV_CACHE: ("kv_cache", "cuda_graph")}
_SAMPLE_SEED_STRIDE = 65537  # sample k of a call seeded s draws with s * stride + k: no overlap across calls
_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def server_args(config, model_path: str, engine_id: int) -> dict[str, Any]:
    """``sglang.Engine``'s keywords for this run: the model folder, ``--sglang-tp-size``,
    ``--sglang-mem-fraction-static``, the memory saver under ``--colocate``, the engine's seed and dtype, the
    routed experts' capture under ``--use-rollout-routing-replay``, then the ``--sglang-server-arg`` pass-through
    (which may not override these)."""
    rollout = config.rollout
    args: dict[str, Any] = {"model_path": model_path, "tp_size": rollout.sglang_tp_size,
                            "enable_memory_saver": bool(config.cluster.colocate), "base_gpu_id": 0,
                            "random_seed": rollout.rollout_seed + engine_id, "dtype": _DTYPES[config.model.model_dtype],
                            "skip_server_warmup": True}
    if rollout.sglang_mem_fraction_static is not None:
        args["mem_fraction_static"] = rollout.sglang_mem_fraction_static
    if config.training.use_rollout_routing_replay:
        args["enable_return_routed_experts"] = True
    args.update(parse_server_args(rollout.sglang_server_arg))
    return args


def sglang_sampling_params(sp: SamplingParams, sample: int) -> dict[str, Any]:
    """sglang's sampling params for sample ``sample`` of a call (one sample per request)."""
    out: dict[str, Any] = {"temperature": sp.temperature, "top_p": sp.top_p, "max_new_tokens": sp.max_new_tokens}
    if sp.stop_token_ids is not None:
        out["stop_token_ids"] = [int(t) for t in sp.stop_token_ids]
    if sp.seed is not None:
        out["sampling_seed"] = int(sp.seed) * _SAMPLE_SEED_STRIDE + sample
    return out


def _bad_output(index: int, problem: str) -> SglangCallError:
    return SglangCallError("generate", f"output {index}: {problem}")


_SHOWN_KEYS = 12


def _shape(out: Any) -> str:
    """What an output is, for an error: its type, and for a dict its keys and the type of its meta_info."""
    if not isinstance(out, dict):
        return f"a {type(out).__name__}"
    keys = sorted(str(key)[:40] for key in out)  # a server's keys are untrusted: short and few
    shown = ", ".join(keys[:_SHOWN_KEYS]) + (f", ... ({len(keys)} keys)" if len(keys) > _SHOWN_KEYS else "")
    meta = f", meta_info a {type(out['meta_info']).__name__}" if "meta_info" in out else ", no meta_info"
    return f"a dict with keys [{shown}]{meta}"


def _finish_reason(index: int, meta: dict) -> str:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        raise _bad_output(index, f"sglang aborted the request: {reason.get('message', reason)}")
    if kind not in ("stop", "length"):
        raise _bad_output(index, f"finish_reason {reason!r} is neither stop nor length")
    return kind


def _routes(index: int, meta: dict, route_layout: RoutedExpertsLayout, sequence_tokens: int) -> Routes:
    if "routed_experts" not in meta:
        raise _bad_output(index, "meta_info has no routed_experts: start the sglang server with "
                                 "--enable-return-routed-experts (an in-process engine gets it from "
                                 "--use-rollout-routing-replay)")
    try:
        return route_layout.routes(meta["routed_experts"], sequence_tokens)
    except RoutesError as e:
        raise _bad_output(index, str(e)) from None


def _sample(index: int, prompt_index: int, prompt: list[int], out: Any, return_logprob: bool,
            weight_version: int, route_layout: Optional[RoutedExpertsLayout] = None) -> Sample:
    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
        raise _bad_output(index, f"expected a dict with a meta_info dict; got {_shape(out)}")
    meta = out["meta_info"]
    ids = out.get("output_ids")
    logprobs: list[float] = []
    if return_logprob:
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list):
            raise _bad_output(index, "meta_info has no output_token_logprobs list (was return_logprob sent?)")
        try:
            logprobs = [float(t[0]) for t in triples]
            logprob_ids = [int(t[1]) for t in triples]
        except (TypeError, ValueError, IndexError):
            raise _bad_output(index, "output_token_logprobs are not (logprob, token_id, text) triples") from None
        if ids is None:
            ids = logprob_ids
        elif [int(t) for t in ids] != logprob_ids:
            raise _bad_output(index, f"output_ids {list(ids)[:8]}... differ from the token ids of "
                                     f"output_token_logprobs {logprob_ids[:8]}...")
    if not isinstance(ids, list):
        raise _bad_output(index, "no output_ids (and no log-probs to take the token ids from)")
    routes = _routes(index, meta, route_layout, len(prompt) + len(ids)) if route_layout is not None else None
    return Sample(index=index, prompt_index=prompt_index, prompt_ids=list(prompt), response_ids=[int(t) for t in ids],
                  response_logprobs=logprobs, response_text=str(out.get("text") or ""),
                  finish_reason=_finish_reason(index, meta), weight_version=weight_version, routes=routes)


def samples_from_outputs(outputs: Any, prompts: list[list[int]], n: int, return_logprob: bool,
                         weight_version: int, route_layout: Optional[RoutedExpertsLayout] = None) -> list[Sample]:
    """The contract's samples from sglang's answer to a batch of ``len(prompts) * n`` requests, prompt-major;
    with ``route_layout`` (R3) each carries its routes from ``meta_info["routed_experts"]``."""
    expected = len(prompts) * n
    if isinstance(outputs, dict) and expected == 1:
        outputs = [outputs]  # sglang answers a batch of one with a bare dict
    if not isinstance(outputs, list) or len(outputs) != expected:
        got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
        raise SglangCallError("generate", f"expected {expected} outputs ({len(prompts)} prompts x n={n}), got {got}")
    return [_sample(k, k // n, prompts[k // n], out, return_logprob, weight_version, route_layout)
            for k, out in enumerate(outputs)]


def _result_view(result: Any) -> Any:
    """sglang's in-process answers are dataclasses (``FlushCacheReqOutput``): as a dict, to be checked."""
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    return result


class SglangRolloutEngine:
    """The contract on sglang, through ``transport`` (:class:`InProcessSglang` or :class:`HttpSglang`: anything
    with ``request(endpoint, body)``, ``version``, ``tp_size``, ``where``, ``health()``, ``shutdown()``).

    ``tp_size`` must be the engine's tensor-parallel size (checked against the transport's); ``payloads``
    builds the payloads of ``(name, tensor)`` pairs (default: sglang's own classes, imported at the first such
    update); ``route_layout`` (R3): each generate asks for the routed experts and the samples carry them."""

    weight_payload = SGLANG_FLATTENED_BUCKET

    def __init__(self, transport: Any, *, tp_size: int, engine_id: int = 0, payloads: Any = None,
                 route_layout: Optional[RoutedExpertsLayout] = None):
        self.transport = transport
        self.route_layout = route_layout
        self.version = parse_version(transport.version)
        if transport.tp_size != tp_size:
            raise ValueError(f"{transport.where} runs with tp_size {transport.tp_size!r}, and --sglang-tp-size is "
                             f"{tp_size}: pass --sglang-tp-size {transport.tp_size!r}")
        self.tp_size = tp_size
        self.engine_id = engine_id
        self.device = transport.where
        self.sessions_on_server = needs_weight_session(self.version)
        self._payloads = payloads
        self._state = EngineState(engine_id)  # released tags, the open weight update, a generate running
        self._flush_pending = False
        self._groups: set[str] = set()
        self._closed = False
        self.weight_version = 0
        logger.info("rollout engine %d: %s", engine_id, self.get_description())

    @classmethod
    def from_config(cls, config, engine_id: int = 0) -> "SglangRolloutEngine":
        """A client of engine ``engine_id``'s server (the ``engine_id``-th ``--sglang-url``), or an in-process
        ``sglang.Engine`` of the policy's folder."""
        rollout = config.rollout
        route_layout = None
        if config.training.use_rollout_routing_replay:  # validation: an --hf-checkpoint MoE policy
            with open(os.path.join(config.model.hf_checkpoint, "config.json")) as f:
                route_layout = RoutedExpertsLayout.of_config(json.load(f))
        if rollout.sglang_url:
            return cls(HttpSglang(rollout.sglang_url[engine_id], timeout_s=rollout.sglang_request_timeout),
                       tp_size=rollout.sglang_tp_size, engine_id=engine_id, route_layout=route_layout)
        from miles.models import resolve_policy_source

        source = resolve_policy_source(config)
        if source.path is None:
            raise ValueError(f"--rollout-engine sglang loads the model from a HuggingFace folder, and the policy is "
                             f"{source.description}: pass --hf-checkpoint DIR")
        transport = InProcessSglang(server_args(config, source.path, engine_id))
        return cls(transport, tp_size=rollout.sglang_tp_size, engine_id=engine_id, route_layout=route_layout)

    # ---------------------------------------------------------------------------------- info

    def get_description(self) -> str:
        session = "begin/end sessions on the server" if self.sessions_on_server else "no server-side sessions"
        return (f"sglang {'.'.join(map(str, self.version))} ({self.transport.where}, tp {self.tp_size}; "
                f"{session})")

    def get_weight_version(self) -> int:
        return self.weight_version

    def health(self) -> bool:
        return not self._closed and self.transport.health()

    def _request(self, endpoint: str, body: Optional[dict] = None) -> Any:
        if self._closed:
            raise RuntimeError(f"rollout engine {self.engine_id}: {endpoint}() after close()")
        return self.transport.request(endpoint, body)

    # ---------------------------------------------------------------------------------- generate

    def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: Union[SamplingParams, dict, None] = None,
                 return_logprob: bool = True) -> list[Sample]:
        """See :meth:`miles.rollout.contract.RolloutEngine.generate`."""
        self._state.check_generate()
        sp = SamplingParams.coerce(sampling_params).check()
        prompts = check_prompts(input_ids)
        if self._flush_pending:  # prompts cached before the update were computed with the old weights
            self.flush_cache()
        requests = [ids for ids in prompts for _ in range(sp.n)]
        body = {"input_ids": requests, "sampling_params": [sglang_sampling_params(sp, k) for k in range(len(requests))],
                "return_logprob": bool(return_logprob)}
        if self.route_layout is not None:
            body["return_routed_experts"] = True
        with self._state.generating_call():
            outputs = self._request("generate", body)
        return samples_from_outputs(outputs, prompts, sp.n, bool(return_logprob), self.weight_version,
                                    self.route_layout)

    def flush_cache(self) -> None:
        """sglang's radix cache: prompt prefixes computed with the weights of their time."""
        result = _result_view(self._request("flush_cache"))
        if isinstance(result, dict) and result.get("success") is False:
            raise SglangCallError("flush_cache", str(result.get("message") or "success=False"), self.transport.where)
        self._flush_pending = False

    # ---------------------------------------------------------------------------------- memory

    def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> dict:
        """See :meth:`miles.rollout.contract.RolloutEngine.release_memory_occupation` (0 bytes: sglang does not
        say)."""
        tags = check_memory_tags(tags)
        self._state.check_release(tags)
        changing = [t for t in tags if t not in self._state.released]
        if changing:
            self._request("release_memory_occupation", {"tags": [s for t in changing for s in SGLANG_TAGS[t]]})
            self._state.released.update(changing)
        return {t: 0 for t in tags}

    def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> dict:
        """See :meth:`miles.rollout.contract.RolloutEngine.resume_memory_occupation`: resumed ``"weights"`` are
        undefined until the next update (sglang keeps no backup)."""
        tags = check_memory_tags(tags)
        changing = [t for t in tags if t in self._state.released]
        if changing:
            self._request("resume_memory_occupation", {"tags": [s for t in changing for s in SGLANG_TAGS[t]]})
            self._state.released.difference_update(changing)
        return {t: 0 for t in tags}

    # ---------------------------------------------------------------------------------- weights

    def begin_weight_update(self, version: int) -> None:
        """See :meth:`miles.rollout.contract.RolloutEngine.begin_weight_update`."""
        self._state.begin(version)
        if self.sessions_on_server:
            try:
                self._request("begin_weight_update", {"selector": "all"})
            except BaseException:
                self._state.session = None  # the server opened nothing
                raise

    def end_weight_update(self, version: int) -> dict:
        """See :meth:`miles.rollout.contract.RolloutEngine.end_weight_update`."""
        session = self._state.ending(version)
        if self.sessions_on_server:
            self._request("end_weight_update", {})
        self._state.end(version)
        self.weight_version = session.version
        self._flush_pending = True
        return {"version": session.version, "tensors": session.tensors, "bytes": session.bytes}

    def _payload_builder(self):
        if self._payloads is None:
            from miles.rollout.sglang.payloads import SglangPayloads

            self._payloads = SglangPayloads.from_sglang()
        return self._payloads

    def _build_payloads(self, items: list, load_format: Optional[str]):
        """``(payloads, keep_alive, stats)`` for sglang from what the contract's caller passed."""
        if load_format is None:
            built = self._payload_builder().build(items, self.tp_size)
            return built.payloads, built, {"tensors": built.tensors, "bytes": built.bytes}
        if not items or not all(isinstance(p, (str, bytes)) for p in items):
            kinds = sorted({type(p).__name__ for p in items})
            raise TypeError(f"load_format 'flattened_bucket' takes {self.tp_size} payload(s) of sglang's flattened "
                            f"bucket serialized for sglang ({SGLANG_FLATTENED_BUCKET}, one per tensor-parallel rank, "
                            f"built by miles.weights.push); got {len(items)} of {kinds}")
        if len(items) != self.tp_size:
            raise ValueError(f"pre-serialized sglang payloads go one per tensor-parallel rank: {self.tp_size} "
                             f"expected, got {len(items)}")
        return list(items), None, {"tensors": 0, "bytes": 0}  # the sender knows what it packed

    def update_weights_from_tensor(self, serialized_named_tensors: list, load_format: Optional[str] = FLATTENED_BUCKET,
                                   flush_cache: bool = False) -> dict:
        """See :meth:`miles.rollout.contract.RolloutEngine.update_weights_from_tensor`. Names are checked by
        sglang's model loader (sglang's ``load_weights`` names, the HF checkpoint's)."""
        session = self._state.open_session("update_weights_from_tensor")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
        payloads, keep_alive, stats = self._build_payloads(list(serialized_named_tensors), load_format)
        try:  # CUDA payloads are IPC handles of keep_alive's flat: it lives until sglang has read it
            self._request("update_weights_from_tensor", {"serialized_named_tensors": payloads,
                                                         "load_format": FLATTENED_BUCKET, "flush_cache": False})
        finally:
            if keep_alive is not None:
                keep_alive.release()
        session.count(stats)
        if flush_cache:
            self.flush_cache()
        return stats

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> None:
        """See :meth:`miles.rollout.contract.RolloutEngine.init_weights_update_group`. sglang's ranks take
        ``rank_offset .. rank_offset + tp_size - 1``: ``world_size`` counts every tensor-parallel rank."""
        if group_name in self._groups:
            raise ValueError(f"rollout engine {self.engine_id} already joined weight update group {group_name!r}; "
                             "destroy it first or pick another name")
        self._request("init_weights_update_group", {"master_address": master_address, "master_port": master_port,
                                                    "rank_offset": rank_offset, "world_size": world_size,
                                                    "group_name": group_name, "backend": backend})
        self._groups.add(group_name)

    def update_weights_from_distributed(self, bucket_specs: list[dict], group_name: str, src: int = 0) -> dict:
        """See :meth:`miles.rollout.contract.RolloutEngine.update_weights_from_distributed`. sglang receives each
        bucket as one broadcast from rank 0 into a bucket of its own class built from the spec's names, dtypes
        and shapes: the sender broadcasts that bucket's flat (:data:`SGLANG_FLATTENED_BUCKET`), not miles'."""
        from miles.weights import BucketSpec

        session = self._state.open_session("update_weights_from_distributed")
        if group_name not in self._groups:
            raise KeyError(f"rollout engine {self.engine_id} has not joined weight update group {group_name!r} "
                           f"(joined: {sorted(self._groups)}); call init_weights_update_group first")
        if src != 0:
            raise ValueError(f"sglang receives weight broadcasts from rank 0 of the group, got src={src}")
        specs = [BucketSpec.from_dict(d) for d in bucket_specs]  # all validated before any is received
        total = {"tensors": 0, "bytes": 0}
        for spec in specs:
            self._request("update_weights_from_distributed", {
                "names": [t.name for t in spec.tensors], "dtypes": [t.dtype for t in spec.tensors],
                "shapes": [list(t.shape) for t in spec.tensors], "group_name": group_name, "flush_cache": False,
                "load_format": FLATTENED_BUCKET})
            total["tensors"] += len(spec.tensors)
            total["bytes"] += sum(t.nbytes for t in spec.tensors)
        session.count(total)
        return total

    def destroy_weights_update_group(self, group_name: str) -> None:
        """See :meth:`miles.rollout.contract.RolloutEngine.destroy_weights_update_group`."""
        if group_name not in self._groups:
            raise KeyError(f"rollout engine {self.engine_id} has not joined weight update group {group_name!r} "
                           f"(joined: {sorted(self._groups)})")
        self._request("destroy_weights_update_group", {"group_name": group_name})
        self._groups.discard(group_name)

    def close(self) -> None:
        """Leave every weight-update group and shut an in-process engine down (a server is left running)."""
        if self._closed:
            return
        for name in sorted(self._groups):
            self.destroy_weights_update_group(name)
        self._closed = True
        self.transport.shutdown()
