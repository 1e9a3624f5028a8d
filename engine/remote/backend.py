"""RemoteBackend: drive an existing OpenAI-compatible server (vLLM, SGLang, llama.cpp's
llama-server) through the same interface as the local engine (engine.backend).

    backend = RemoteBackend("http://127.0.0.1:8080", model=None, api_key_env="MY_KEY")
    for event in backend.generate([{"role": "user", "content": "Hi"}], SamplingParams()):
        ...

Connecting checks, each with a message that says what to do: the server answers within
5 s, it lists models at /v1/models (an OpenAI-compatible server), the API key (read from
the environment variable the user names, never stored) is accepted, and the model is one
it serves. The kind (vllm / sglang / llama.cpp / openai) comes from /metrics names or
/props unless given. Settings the server fixes at launch are reported read-only, with the
flag that sets each; sampling and max_tokens, and what a kind lets a request carry, go
with every request. TLS certificates are verified unless the caller passes verify=False
or a CA bundle path. `list_served_models(url)` asks /v1/models alone, with the same checks
and messages, for choosing a model before connecting.
"""
from __future__ import annotations

import os

import httpx

from engine.backend import ReconfigureResult, run_to_end
from engine.config import BY_KEY, ENGINE, SamplingParams, validate
from engine.remote.chunk_stream import ChunkStream
from engine.errors import (ConfigError, NotOpenAIServerError, ServerAuthError, ServerRequestError,
                           ServerSettingFixedError, ServerUnreachableError, UnknownServedModelError,
                           WorkbenchError)
from engine.remote.request import RemoteRequest
from engine.remote.server_kinds import KINDS, LAUNCH_KEYS, LLAMACPP, OPENAI, SGLANG, kind_of_props, launch_settings
from engine.remote.server_metrics import MetricsReading, kind_of_metrics, read_metrics

CONNECT_TIMEOUT_S = 5.0        # "unreachable" is reported within this
READ_TIMEOUT_S = 300.0         # between two streamed chunks (a long prefill on a busy server)
PROBE_TIMEOUT_S = 5.0          # /v1/models, /metrics, /props, /slots


class RemoteBackend:
    def __init__(self, url: str, model: str | None = None, *, kind: str | None = None,
                 api_key_env: str | None = None, verify: bool | str = True, poll_interval_s: float = 0.5):
        if kind is not None and kind not in KINDS:
            raise ConfigError(f"unknown server kind {kind!r}; choose one of {', '.join(KINDS)} or leave it to detection")
        self.url = normalize_url(url)
        self.api_key_env, self.verify, self.poll_interval_s = api_key_env, verify, poll_interval_s
        self.client = new_client(self.url, api_key_env, verify)
        try:
            self._attach(model, kind)
        except BaseException:
            self.client.close()
            raise

    def _attach(self, model: str | None, kind: str | None) -> None:
        self.served_models = served_models(self.client, self.url, self.api_key_env)
        self.model = self._choose_model(model)
        metrics_text = self._metrics_text()
        self.kind = KINDS[kind or self._detect_kind(metrics_text)]
        slots = self._json_or_none("/slots") if self.kind.name == LLAMACPP else None
        self.launch, self.version = launch_settings(self.kind.name, self._info(), metrics_text, slots)
        self.request_settings: dict = {}      # settings carried per request (reconfigure)
        self.active: RemoteRequest | None = None

    # ---- connecting -----------------------------------------------------------------
    def _get(self, path: str) -> httpx.Response:
        return probe(self.client, self.url, path)

    def _choose_model(self, model: str | None) -> str:
        if not model:
            if len(self.served_models) == 1:
                return self.served_models[0]
            raise UnknownServedModelError(
                f"{self.url} serves {len(self.served_models)} models: {', '.join(self.served_models) or 'none'}. "
                "Choose one of them.")
        if model not in self.served_models:
            raise UnknownServedModelError(
                f"{self.url} does not serve the model {model!r}; it serves: "
                f"{', '.join(self.served_models) or 'none'}. Choose one of those.")
        return model

    def _metrics_text(self) -> str | None:
        """/metrics as text, or None (self.metrics_missing says why)."""
        self.metrics_missing = None
        response = self._get("/metrics")
        if response.status_code != 200:
            self.metrics_missing = f"/metrics answered HTTP {response.status_code}"
            return None
        try:
            kind_of_metrics(response.text)
        except ValueError:
            self.metrics_missing = "/metrics is not Prometheus text"
            return None
        return response.text

    def _detect_kind(self, metrics_text: str | None) -> str:
        kind = kind_of_metrics(metrics_text) if metrics_text else None
        if kind is None:
            kind = kind_of_props(self._json_or_none("/props"))
        if kind is None and self._json_or_none("/get_server_info") is not None:
            kind = SGLANG
        return kind or OPENAI

    def _json_or_none(self, path: str):
        try:
            response = self._get(path)
            return response.json() if response.status_code == 200 else None
        except (ValueError, ServerUnreachableError):
            return None

    def _info(self) -> dict | None:
        return self._json_or_none(self.kind.info_path) if self.kind.info_path else None

    # ---- what the app reads -----------------------------------------------------------
    def metrics_note(self) -> str | None:
        """None when /metrics is read; else what that means for the plots."""
        if self.metrics_missing is None:
            return None
        return (f"no server metrics ({self.metrics_missing}; {self.kind.label}: turn them on with "
                f"{self.kind.metrics_flag}): the plots fill from per-request data only")

    @property
    def drafts_per_request(self) -> bool:
        """Does the stream count this request's drafts (else only server-wide counters do)?"""
        return self.kind.drafts_per_request

    @property
    def kv_cache_dtype(self) -> str | None:
        return self.launch.get("kv_cache_dtype")

    def settings(self) -> dict:
        """The settings in effect. Those fixed at server launch are listed under "read_only"
        with the flag that sets each; None: the server does not reveal the value."""
        values = {key: self.request_settings.get(key, self.launch.get(key)) for key in LAUNCH_KEYS}
        return {"backend": "remote", "server_kind": self.kind.name, "server": self.kind.label,
                "server_version": self.version, "url": self.url, "model": self.model,
                "api_key_env": self.api_key_env, "tls_verified": self.verify is not False,
                **values,
                "read_only": {k: f for k, f in self.kind.launch_flags.items() if k not in self.kind.per_request},
                "per_request": sorted(self.kind.per_request),
                "metrics": self.metrics_note() or "available",
                "prefix_cache_reset": " ".join(filter(None, (self.kind.reset_endpoint, self.kind.reset_note))) or None}

    def scrape(self) -> MetricsReading | None:
        if self.metrics_missing is not None:
            return None
        try:
            response = self._get("/metrics")
            return read_metrics(self.kind.name, response.text) if response.status_code == 200 else None
        except (ServerUnreachableError, ValueError):
            return None

    def kv_usage(self) -> float | None:
        """The share of the server's KV cache in use: llama.cpp from /slots (tokens held per
        slot over the slot context), others from their /metrics gauge."""
        if self.kind.name == LLAMACPP:
            return self._slots_kv_usage()
        reading = self.scrape()
        return reading.kv_usage if reading is not None else None

    def _slots_kv_usage(self, slots=None) -> float | None:
        slots = self._json_or_none("/slots") if slots is None else slots
        if not isinstance(slots, list) or not slots:
            return None
        held = sum(int(s.get("n_prompt_tokens") or 0) for s in slots)
        capacity = sum(int(s.get("n_ctx") or 0) for s in slots)
        return held / capacity if capacity else None

    def server_load(self) -> dict:
        """The server's load now: running and waiting requests, the share of its KV cache in
        use and its preemption counter (engine.remote.server_metrics), None where it does not
        say. llama.cpp: KV usage from /slots, and running too when /metrics is off."""
        reading = self.scrape() or MetricsReading()
        load = {"running": reading.running, "waiting": reading.waiting, "kv_usage": reading.kv_usage,
                "preemptions": reading.preemptions}
        if self.kind.name == LLAMACPP:
            slots = self._json_or_none("/slots")
            load["kv_usage"] = self._slots_kv_usage(slots)
            if load["running"] is None and isinstance(slots, list):
                load["running"] = sum(bool(s.get("is_processing")) for s in slots)
        return load

    def slot_count(self) -> int | None:
        """How many requests the server serves at once, where it says (llama.cpp: --parallel)."""
        if self.kind.name != LLAMACPP:
            return None
        props = self._info() or {}
        return props.get("total_slots")

    # ---- requests ---------------------------------------------------------------------
    def start(self, prompt, params: SamplingParams | None = None) -> RemoteRequest:
        if self.active is not None:
            raise WorkbenchError("a request is already running: wait for it to finish or cancel it")
        body = self.request_body(_messages(prompt), params or SamplingParams())
        before = self.scrape()
        self.active = RemoteRequest(self, ChunkStream(self.client, body), before)
        return self.active

    def open_stream(self, prompt, params: SamplingParams | None = None) -> RemoteRequest:
        """One of many concurrent requests (engine.remote.concurrent_streams): not the backend's
        one active request, and without per-request server figures, since the server-wide
        counters would mix every concurrent request's traffic."""
        body = self.request_body(_messages(prompt), params or SamplingParams())
        return RemoteRequest(self, ChunkStream(self.client, body), None)

    def request_body(self, messages: list[dict], params: SamplingParams) -> dict:
        body = {"model": self.model, "messages": messages, "stream": True, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, **self.kind.stream_fields}
        if params.top_k:
            body["top_k"] = params.top_k
        if params.seed is not None:
            body["seed"] = params.seed
        if not params.stop_on_eos:
            body["ignore_eos"] = True
        for key, value in self.request_settings.items():
            body[self.kind.per_request[key]] = value
        return body

    def generate(self, prompt, params: SamplingParams | None = None):
        return run_to_end(self, prompt, params)

    def request_closed(self, request: RemoteRequest) -> None:
        if request is self.active:
            self.active = None

    def cancel(self) -> None:
        request = self.active
        if request is not None:
            request.cancel()

    def close(self) -> None:
        if self.active is not None:
            self.active.close()
        self.client.close()

    # ---- settings ---------------------------------------------------------------------
    def reconfigure(self, **changes):
        """Settings this kind lets a request carry apply from the next request; the rest
        are fixed at launch (ServerSettingFixedError names the flag) or do not apply."""
        for key, value in changes.items():
            self._check_changeable(key)
            validate(key, value)
        self.request_settings.update(changes)
        return ReconfigureResult({} if self.active else dict(changes), dict(changes) if self.active else {})

    def set_draft_model(self, reference: str | None, progress=None) -> None:
        """engine.backend.Backend.set_draft_model: a server's draft is fixed at launch, so
        this answers as reconfigure(draft_model=...) does, with the flag that sets it."""
        self.reconfigure(draft_model=reference)

    def _check_changeable(self, key: str) -> None:
        if key in self.kind.per_request:
            return
        if key == "draft_model":
            flag = self.kind.launch_flags.get("proposer")      # the flag that names the draft, too
            raise ServerSettingFixedError(
                f"a server's draft model is fixed when it is launched: restart the {self.kind.label} with the "
                f"draft you want{f' ({flag})' if flag else ''}, or load a local model")
        if key in self.kind.launch_flags:
            raise ServerSettingFixedError(
                f"{key} is fixed when the {self.kind.label} is launched: restart it with {self.kind.launch_flags[key]}")
        setting = BY_KEY.get(key)
        what = "an engine setting of the local engine" if setting is not None and setting.section == ENGINE else \
            "not a setting a remote server takes here"
        raise ConfigError(f"{key!r} is {what}; on this {self.kind.label} a request can carry: "
                          f"{', '.join(sorted(self.kind.per_request)) or 'sampling and max_tokens only'}")

    def reset_prefix_cache(self) -> None:
        """Through the server's endpoint (settings()["prefix_cache_reset"] says which and
        what the server needs for it); llama.cpp: erase every slot."""
        if self.kind.name == LLAMACPP:
            return self._erase_llamacpp_slots()
        if self.kind.reset_endpoint is None:
            raise ServerRequestError(f"the workbench knows no prefix-cache reset endpoint for a {self.kind.label}")
        self._post_reset(self.kind.reset_endpoint)

    def _erase_llamacpp_slots(self) -> None:
        slots = self._json_or_none("/slots")
        if not isinstance(slots, list):
            raise ServerRequestError("llama-server does not list its slots (GET /slots); start it with --slots")
        for slot in slots:
            self._post_reset(f"/slots/{slot['id']}?action=erase")

    def _post_reset(self, path: str) -> None:
        try:
            response = self.client.post(path, timeout=PROBE_TIMEOUT_S)
        except httpx.TransportError as e:
            raise ServerUnreachableError(_transport_message(self.url, e)) from e
        if response.status_code != 200:
            note = f" ({self.kind.reset_note})" if self.kind.reset_note else ""
            raise ServerRequestError(
                f"the server did not reset its prefix cache: POST {path} answered HTTP {response.status_code}"
                f"{note}: {response.text.strip()[:200]}")


def normalize_url(url: str) -> str:
    """The server's base URL: a scheme is required; a trailing /v1 is dropped."""
    url = (url or "").strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"the server URL must start with http:// or https://, got {url!r} "
                          "(for example http://127.0.0.1:8080)")
    return url.removesuffix("/v1")


def list_served_models(url: str, *, api_key_env: str | None = None, verify: bool | str = True) -> list[str]:
    """The model ids the server at `url` lists at /v1/models, to choose one before
    connecting. Raises what connecting would: unreachable (within 5 s), not an
    OpenAI-compatible server, API key refused or its variable not set."""
    url = normalize_url(url)
    with new_client(url, api_key_env, verify) as client:
        return served_models(client, url, api_key_env)


def served_models(client: httpx.Client, url: str, api_key_env: str | None) -> list[str]:
    response = probe(client, url, "/v1/models")
    if response.status_code in (401, 403):
        raise ServerAuthError(
            f"{url} refused the API key (HTTP {response.status_code}). "
            + (f"Check the key in ${api_key_env}." if api_key_env else
               "Name the environment variable that holds the server's API key."))
    try:
        return [entry["id"] for entry in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as e:
        raise NotOpenAIServerError(
            f"{url} is not an OpenAI-compatible server: GET /v1/models answered HTTP "
            f"{response.status_code} ({response.headers.get('content-type', 'no content type')}) without a "
            "model list. Give the base URL of a vLLM, SGLang or llama.cpp server, e.g. http://127.0.0.1:8080."
        ) from e


def probe(client: httpx.Client, url: str, path: str) -> httpx.Response:
    """GET a small endpoint (/v1/models, /metrics, /props, /slots) within PROBE_TIMEOUT_S."""
    try:
        return client.get(path, timeout=PROBE_TIMEOUT_S)
    except httpx.TimeoutException as e:
        raise ServerUnreachableError(
            f"no answer from {url} within {PROBE_TIMEOUT_S:g} s ({type(e).__name__}). Check the address "
            "and port, and that the server has finished starting.") from e
    except httpx.TransportError as e:
        raise ServerUnreachableError(_transport_message(url, e)) from e


def new_client(url: str, api_key_env: str | None, verify: bool | str) -> httpx.Client:
    """The HTTP client for one server (its caller closes it); TLS verified unless told otherwise.
    No cap on its connections: httpx's default of 100 would hold the 101st of many concurrent
    streams (engine.remote.concurrent_streams) in the client, and count the wait as TTFT."""
    return httpx.Client(base_url=url, headers=_auth_headers(api_key_env), verify=verify,
                        timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


def _auth_headers(api_key_env: str | None) -> dict:
    """The key is read from the environment only and lives in the client's headers; it is
    never part of settings(), a profile or a log line."""
    if not api_key_env:
        return {}
    key = os.environ.get(api_key_env)
    if not key:
        raise ServerAuthError(f"the environment variable {api_key_env} (named for the API key) is not set; "
                              "set it before connecting, or leave the API key variable empty")
    return {"Authorization": f"Bearer {key}"}


def _messages(prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return prompt
    raise ConfigError("a remote server takes text or chat messages, not token ids")


def _transport_message(url: str, error: Exception) -> str:
    text = str(error)
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
        return (f"the TLS certificate of {url} could not be verified ({text}). Give the CA bundle that signed it, "
                "or connect with verification off only if you trust the network.")
    return (f"cannot reach {url} ({type(error).__name__}: {text}). Check the address and port, "
            "and that the server is running.")
