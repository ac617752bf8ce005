"""A fake sglang for CPU tests: the RL calls of ``sglang.Engine`` with sglang's state machine and answer shapes.

Written for miles' tests (not taken from sglang). What it enforces, as sglang does or must be assumed to:

- memory tags ``weights``, ``kv_cache``, ``cuda_graph``, each released or resident; releasing a released
  tag, resuming a resident one, or releasing while a generate runs is an error;
- released weights come back undefined: generate refuses until weights were pushed after the resume;
- ``generate`` needs every tag resident;
- ``update_weights_from_tensor`` needs ``weights`` resident, exactly one payload per tensor-parallel rank
  (each deserialized once, by "its" rank), ``load_format="flattened_bucket"``; from version 0.5.21 only
  between ``begin_weight_update`` and ``end_weight_update`` (else ``success=False``);
- answers: ``generate`` -> a list of ``{"text", "output_ids", "meta_info": {"finish_reason": {"type"...},
  "output_token_logprobs": [(logprob, token_id, None), ...], ...}}``; updates -> ``(success, message)``;
  release/resume -> None; flush_cache -> an object with ``success``.

The "model" is a bigram table (next-token logits = ``table[previous token]``) seeded by ``random_seed``;
log-probs are ``log_softmax(logits / temperature)`` of the sampled token (temperature 0: greedy, log-probs
at temperature 1). Pushed tensors are kept in ``engine.weights``. ``FakeSglangServer`` serves an engine over
HTTP with the server's endpoint names, status codes and bodies.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

import torch
import torch.distributed
import torch.multiprocessing  # noqa: F401  (torch's reducers for ForkingPickler)

TAGS = ("weights", "kv_cache", "cuda_graph")
SESSION_SINCE = (0, 5, 21)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3])


# ------------------------------------------------------------------------------ sglang's two weight classes


@dataclass
class FakeTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FakeFlattenedTensorBucket:
    """The interface of sglang's FlattenedTensorBucket (from named tensors, or a flat + metadata), with a layout
    of its own: each tensor's bytes padded to 16, so a client that assumed a layout instead of using the class
    would be caught."""

    PAD = 16

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is not None:
            if not named_tensors:
                raise ValueError("Cannot create empty tensor bucket")
            pieces, self.metadata, at = [], [], 0
            for name, tensor in named_tensors:
                raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                pad = -raw.numel() % self.PAD
                pieces += [raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)]
                self.metadata.append(FakeTensorMetadata(name, tensor.shape, tensor.dtype, at, at + raw.numel(),
                                                        raw.numel()))
                at += raw.numel() + pad
            self.flattened_tensor = torch.cat(pieces)
        else:
            if flattened_tensor is None or metadata is None:
                raise ValueError("Must provide either named_tensors or both flattened_tensor and metadata")
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self):
        return self.flattened_tensor

    def get_metadata(self):
        return self.metadata

    def reconstruct_tensors(self):
        return [(m.name, self.flattened_tensor[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
                for m in self.metadata]


class FakeSerializer:
    """sglang's MultiprocessingSerializer's contract: a ForkingPickler dump, base64 text with output_str."""

    @staticmethod
    def serialize(obj, output_str: bool = False):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        data = buf.getvalue()
        return base64.b64encode(data).decode() if output_str else data

    @staticmethod
    def deserialize(data):
        if isinstance(data, str):
            data = base64.b64decode(data, validate=True)
        return pickle.loads(data)


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


# ------------------------------------------------------------------------------ the weight-update group


def init_custom_process_group(backend, init_method, world_size, rank, group_name, timeout=timedelta(seconds=60)):
    """A process group apart from the default one, made as sglang makes its weight-update groups
    (``sglang.srt.utils.init_custom_process_group``: a TCP rendezvous, the store under the group's name, torch's
    new-group helper), so that a trainer's group must meet sglang's ranks in the same store keys."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


# ------------------------------------------------------------------------------ the engine


class FakeSglangEngine:
    """``sglang.Engine(**server_args)``'s RL surface. ``version`` picks the state machine (session rules from
    0.5.21); ``bucket_cls``/``serializer`` are the classes payloads are read with."""

    def __init__(self, model_path: Optional[str] = None, tp_size: int = 1, random_seed: int = 0,
                 version: str = "0.5.17", vocab_size: Optional[int] = None, bucket_cls=FakeFlattenedTensorBucket,
                 serializer=FakeSerializer, **server_args):
        self.version = version
        self.tp_size = tp_size
        self.server_args = {"model_path": model_path, "tp_size": tp_size, "random_seed": random_seed, **server_args}
        self.bucket_cls, self.serializer = bucket_cls, serializer
        self.vocab_size = vocab_size or self._vocab_from(model_path) or 32
        gen = torch.Generator().manual_seed(random_seed)
        self.table = torch.randn(self.vocab_size, self.vocab_size, generator=gen) * 2
        self.resident = {t: True for t in TAGS}
        self.weights_defined = True  # loaded from model_path at start
        self.weights: dict[str, torch.Tensor] = {}
        self.calls: list[tuple[str, Any]] = []
        self.session_open = False
        self.running = 0
        self.generate_gate: Optional[threading.Event] = None  # a test holds generate here while it runs
        self.groups: dict[str, Any] = {}  # group name -> process group
        self.distributed_requests: list[dict] = []
        self.lock = threading.Lock()
        self.shut_down = False

    @staticmethod
    def _vocab_from(model_path: Optional[str]) -> Optional[int]:
        path = os.path.join(model_path, "config.json") if model_path else None
        if path and os.path.isfile(path):
            with open(path) as f:
                return int(json.load(f)["vocab_size"])
        return None

    @property
    def sessions_required(self) -> bool:
        return _version(self.version) >= SESSION_SINCE

    def _tags(self, tags) -> list[str]:
        tags = list(TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}")
        return tags

    def release_memory_occupation(self, tags=None):
        with self.lock:
            self.calls.append(("release", tags))
            if self.running:
                raise AssertionError("release_memory_occupation while requests are running: only when idle")
            tags = self._tags(tags)
            twice = [t for t in tags if not self.resident[t]]
            if twice:
                raise AssertionError(f"{twice} already released")
            for t in tags:
                self.resident[t] = False
            if "weights" in tags:
                self.weights_defined = False
        return None

    def resume_memory_occupation(self, tags=None):
        with self.lock:
            self.calls.append(("resume", tags))
            tags = self._tags(tags)
            twice = [t for t in tags if self.resident[t]]
            if twice:
                raise AssertionError(f"{twice} already resident")
            for t in tags:
                self.resident[t] = True
        return None

    def begin_weight_update(self, selector: str = "all"):
        if not self.sessions_required:
            raise AttributeError(f"sglang {self.version} has no begin_weight_update")
        self.calls.append(("begin", selector))
        if self.session_open:
            raise AssertionError("begin_weight_update called while a weight-update session is already open")
        self.session_open = True
        return True, "Success"

    def end_weight_update(self):
        if not self.sessions_required:
            raise AttributeError(f"sglang {self.version} has no end_weight_update")
        self.calls.append(("end", None))
        if not self.session_open:
            return False, "end_weight_update without begin_weight_update"
        self.session_open = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights_from_tensor", {"payloads": len(named_tensors), "load_format": load_format,
                                                          "flush_cache": flush_cache}))
        if not self.resident["weights"]:
            return False, "weights are released: resume_memory_occupation(['weights']) before updating them"
        if self.sessions_required and not self.session_open:
            return False, "an update must sit between begin_weight_update and end_weight_update"
        if load_format != "flattened_bucket":
            return False, f"this fake takes load_format='flattened_bucket' payloads, got {load_format!r}"
        if len(named_tensors) != self.tp_size:
            return False, f"expected one payload per TP rank ({self.tp_size}), got {len(named_tensors)}"
        received = []
        for payload in named_tensors:  # every rank opens its own payload, once
            body = self.serializer.deserialize(payload)
            bucket = self.bucket_cls(flattened_tensor=body["flattened_tensor"], metadata=body["metadata"])
            received.append({n: t.clone() for n, t in bucket.reconstruct_tensors()})
        self.received_by_rank = received  # what each tensor-parallel rank read
        self.weights.update(received[0])
        self.weights_defined = True
        return True, "Success"

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        """Joins a real process group the way sglang does (:func:`init_custom_process_group`), one rank (the
        fake's tensor-parallel ranks share one process: tp_size 1 only)."""
        self.calls.append(("init_group", group_name))
        if self.tp_size != 1:
            return False, "this fake joins weight-update groups with tp_size 1 only"
        self.groups[group_name] = init_custom_process_group(
            backend=backend, init_method=f"tcp://{master_address}:{master_port}", world_size=world_size,
            rank=rank_offset, group_name=group_name)
        return True, "Success"

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        """Receives one broadcast from rank 0 into a bucket of its own class built from the names, dtypes and
        shapes (sglang's ``load_format="flattened_bucket"``), and keeps the tensors."""
        if group_name not in self.groups:
            return False, f"Group {group_name} not in {sorted(self.groups)}"
        if self.sessions_required and not self.session_open:
            return False, "an update must sit between begin_weight_update and end_weight_update"
        if load_format != "flattened_bucket":
            return False, f"this fake receives load_format='flattened_bucket' broadcasts, got {load_format!r}"
        self.distributed_requests.append({"names": names, "dtypes": dtypes, "shapes": shapes,
                                          "load_format": load_format, "flush_cache": flush_cache})
        empty = [(n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in zip(names, dtypes, shapes)]
        bucket = self.bucket_cls(named_tensors=empty)
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=self.groups[group_name])
        self.weights.update({n: t.clone() for n, t in bucket.reconstruct_tensors()})
        self.weights_defined = True
        return True, "Success"

    def destroy_weights_update_group(self, group_name):
        group = self.groups.pop(group_name, None)
        if group is not None:
            torch.distributed.destroy_process_group(group)
        return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush_cache", None))
        return FlushCacheReqOutput(success=self.running == 0)

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False, **_):
        if prompt is not None:
            raise ValueError("this fake takes input_ids only")
        with self.lock:
            released = [t for t in TAGS if not self.resident[t]]
            if released:
                raise RuntimeError(f"generate with {released} released")
            if not self.weights_defined:
                raise RuntimeError("generate after resuming weights that were not pushed again: undefined weights")
            self.running += 1
        try:
            if self.generate_gate is not None:
                self.generate_gate.wait(30)
            single = bool(input_ids) and isinstance(input_ids[0], int)
            prompts = [input_ids] if single else list(input_ids)
            params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(prompts)
            outputs = [self._one(ids, sp, return_logprob) for ids, sp in zip(prompts, params)
                       for _ in range(int(sp.get("n", 1)))]
            return outputs[0] if single and len(outputs) == 1 else outputs
        finally:
            with self.lock:
                self.running -= 1

    def _one(self, ids: list[int], sp: dict, return_logprob: bool) -> dict:
        temperature = float(sp.get("temperature", 1.0))
        seed = sp.get("sampling_seed")
        gen = torch.Generator().manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**31, ())))
        stop = set(sp.get("stop_token_ids") or ()) | {0}
        prev, tokens, logprobs, finish = ids[-1] % self.vocab_size, [], [], None
        for _ in range(int(sp.get("max_new_tokens", 128))):
            logits = self.table[prev]
            if temperature == 0:
                token = int(logits.argmax())
                lp = torch.log_softmax(logits, -1)[token]
            else:
                scaled = torch.log_softmax(logits / temperature, -1)
                token = int(torch.multinomial(scaled.exp(), 1, generator=gen))
                lp = scaled[token]
            tokens.append(token)
            logprobs.append(float(lp))
            prev = token
            if token in stop:
                finish = {"type": "stop", "matched": token}
                break
        finish = finish or {"type": "length", "length": len(tokens)}
        meta = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(ids),
                "completion_tokens": len(tokens), "weight_version": "default"}
        if return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(logprobs, tokens)]
        return {"text": "".join(chr(97 + t % 26) for t in tokens), "output_ids": tokens, "meta_info": meta}

    def shutdown(self):
        self.shut_down = True


# ------------------------------------------------------------------------------ the server


class FakeSglangServer:
    """``engine`` behind sglang's HTTP endpoints on 127.0.0.1 (a free port), in a thread. Use as a context
    manager; ``url`` is where it listens."""

    def __init__(self, engine: FakeSglangEngine):
        self.engine = engine
        handler = type("Handler", (_Handler,), {"engine": engine})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    engine: FakeSglangEngine

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, status: int, body: Any, text: bool = False):
        data = body.encode() if text else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        name = self.path.strip("/")
        if name == "health":
            return self._answer(HTTPStatus.OK, "", text=True)
        if name in ("server_info", "get_server_info"):
            return self._answer(HTTPStatus.OK, {"version": self.engine.version, "tp_size": self.engine.tp_size,
                                                **{k: v for k, v in self.engine.server_args.items() if k != "tp_size"}})
        if name == "flush_cache":
            return self.do_POST()
        return self._answer(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})

    def do_POST(self):
        name = self.path.strip("/")
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}") if length else {}
        engine = self.engine
        try:
            if name == "generate":
                return self._answer(HTTPStatus.OK, engine.generate(**body))
            if name in ("release_memory_occupation", "resume_memory_occupation"):
                getattr(engine, name)(**body)
                return self._answer(HTTPStatus.OK, None)
            if name == "flush_cache":
                ok = engine.flush_cache().success
                return self._answer(HTTPStatus.OK if ok else HTTPStatus.BAD_REQUEST,
                                    "Cache flushed.\n" if ok else "Flush cache failed.\n", text=True)
            if name == "update_weights_from_tensor":
                body["named_tensors"] = body.pop("serialized_named_tensors")
            if name in ("update_weights_from_tensor", "begin_weight_update", "end_weight_update",
                        "init_weights_update_group", "update_weights_from_distributed",
                        "destroy_weights_update_group"):
                if name in ("begin_weight_update", "end_weight_update") and not engine.sessions_required:
                    return self._answer(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
                success, message = getattr(engine, name)(**body)
                return self._answer(HTTPStatus.OK if success else HTTPStatus.BAD_REQUEST,
                                    {"success": success, "message": message})
        except Exception as e:  # sglang's _create_error_response
            return self._answer(HTTPStatus.BAD_REQUEST, {"error": {"message": f"{type(e).__name__}: {e}"}})
        return self._answer(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
