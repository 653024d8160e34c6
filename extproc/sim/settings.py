"""Settings for ``extproc sim``: one frozen tree, validated on construction.

Flags map onto these in :mod:`extproc.sim.run`; everything below receives a validated
:class:`SimSettings`. Engine timing and cache sizes live in
:class:`~extproc.sim.engine_core.EngineParams` (its docstring says where the defaults come from).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from extproc.addresses import parse_host_port
from extproc.errors import ConfigError
from extproc.sim.engine_core import EngineParams
from extproc.sim.kv_wire import EventEncoding, HashFormat
from extproc.types import ENGINE_KINDS, EngineKind

#: vLLM's ``KVEventsConfig`` defaults (identical from 0.9.0 to 0.33.0).
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000


@dataclass(frozen=True, slots=True)
class PublisherFaults:
    """Faults injected into the PUB stream, so a subscriber's repair paths can be exercised.

    Set at start (``extproc sim --kv-drop-probability / --kv-delay-ms``), changed at runtime with
    ``set_faults`` (``POST /sim/kv_events``). A dropped batch stays in the replay buffer, its
    sequence number consumed.
    """

    #: Probability (0-1) that a batch is dropped; drawn from the publisher's seeded RNG only when > 0.
    drop_probability: float = 0.0
    #: Drop the next N batches deterministically (counts down as they are dropped).
    drop_next: int = 0
    #: Seconds each batch is held before it goes out on PUB; order is always kept.
    delay_seconds: float = 0.0

    def __post_init__(self) -> None:
        # The messages name the sim's flags too: ``extproc sim`` builds this from them.
        if not 0.0 <= self.drop_probability <= 1.0:
            raise ConfigError(
                f"--kv-drop-probability (drop_probability) must be in 0-1, got {self.drop_probability}"
            )
        if self.drop_next < 0:
            raise ConfigError(f"drop_next must be 0 or more, got {self.drop_next}")
        if self.delay_seconds < 0:
            raise ConfigError(f"--kv-delay-ms must be 0 or more, got {self.delay_seconds * 1000:g}")


@dataclass(frozen=True, slots=True)
class KVEventSettings:
    """The ZMQ publisher of each data-parallel rank (rank r adds r to both ports, as vLLM does).

    ``extproc sim``'s ``--kv-*`` flags build this; the messages name them.
    """

    #: PUB port of rank 0; 0 picks a free port per rank (reported in logs and ``/sim/state``).
    port: int
    #: ROUTER replay port of rank 0; None disables replay.
    replay_port: int | None = None
    topic: str = ""
    encoding: EventEncoding = EventEncoding.MAPS
    hash_format: HashFormat = HashFormat.INT
    #: Replay replies carry the topic frame (vLLM >= 0.26) or not (<= 0.25).
    replay_topic_frame: bool = True
    #: Batches kept for replay (vLLM's ``buffer_steps``).
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    faults: PublisherFaults = field(default_factory=PublisherFaults)

    def __post_init__(self) -> None:
        for flag, port in (("--kv-events-port", self.port), ("--kv-replay-port", self.replay_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"{flag} must be in 0-65535, got {port}")
        if self.port and self.replay_port and self.port == self.replay_port:
            raise ConfigError(f"--kv-events-port and --kv-replay-port are both {self.port}")
        if self.buffer_steps < 1:
            raise ConfigError(f"--kv-buffer-steps must be at least 1, got {self.buffer_steps}")


@dataclass(frozen=True, slots=True)
class LoraModule:
    """A LoRA adapter served beside the base model (vLLM's ``--lora-modules name=path``)."""

    name: str
    path: str

    @classmethod
    def parse(cls, spec: str) -> LoraModule:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules: expected NAME=PATH, got {spec!r}")
        return cls(name=name, path=path)


@dataclass(frozen=True, slots=True)
class SimSettings:
    """Everything one simulated engine (all its data-parallel ranks) needs."""

    #: Whose surface to show: vLLM's, or SGLang's (routes, metric names, KV-event encoding).
    engine_kind: EngineKind = "vllm"
    #: HTTP listen address (OpenAI API, /metrics, /tokenize). Loopback by default; port 0 = any free.
    listen: str = "127.0.0.1:8000"
    #: The model path or Hugging Face id the engine "loads"; ``root`` in ``/v1/models``.
    model: str = "meta-llama/Meta-Llama-3-8B-Instruct"
    #: Names clients may use for the base model; empty means ``(model,)``, as in vLLM.
    served_model_names: tuple[str, ...] = ()
    lora_modules: tuple[LoraModule, ...] = ()
    #: A tokenizer directory (``tokenizer.json`` [+ ``tokenizer_config.json``]); None = the shipped one.
    tokenizer: Path | None = None
    #: A chat template file, or the name of a shipped one (``chatml``, ``llama3``); None = the
    #: tokenizer's own (``tokenizer_config.json``), else ``llama3``.
    chat_template: str | None = None
    #: Bytes of prompt pieces the simulator remembers to encode a repeated prefix once (its segment
    #: tree, as serve's --tokenize-cache-mb); 0 encodes every prompt whole, as vLLM does. It saves a
    #: harness's CPU and changes no id.
    tokenize_cache_bytes: int = 0
    engine: EngineParams = field(default_factory=EngineParams)
    #: Data-parallel ranks: each has its own cache, scheduler and KV-event publisher.
    data_parallel_size: int = 1
    #: Wall seconds per simulated second: 0.1 runs ten times faster than the model says.
    time_scale: float = 1.0
    #: Tokens generated when a chat request sets no ``max_tokens`` (a real model stops at EOS).
    default_output_tokens: int = 128
    #: Report ``usage.prompt_tokens_details.cached_tokens`` (vLLM's --enable-prompt-tokens-details).
    enable_prompt_tokens_details: bool = False
    kv_events: KVEventSettings | None = None
    #: Seeds the fault injection's randomness.
    seed: int = 0

    def __post_init__(self) -> None:
        parse_host_port(self.listen, what="--listen")
        if self.engine_kind not in ENGINE_KINDS:
            raise ConfigError(f"--engine must be one of {', '.join(ENGINE_KINDS)}, got {self.engine_kind!r}")
        if self.kv_events is not None:
            sglang_wire = self.kv_events.encoding == EventEncoding.SGLANG
            if sglang_wire != (self.engine_kind == "sglang"):
                raise ConfigError(
                    f"--engine {self.engine_kind} does not publish the {self.kv_events.encoding} KV-event "
                    "encoding (SGLang's encoding comes with --engine sglang, and only with it)"
                )
        names = self.base_model_names
        for lora in self.lora_modules:
            if lora.name in names:
                raise ConfigError(f"--lora-modules: {lora.name!r} is also a served model name")
        lora_names = [lora.name for lora in self.lora_modules]
        if len(set(lora_names)) != len(lora_names):
            raise ConfigError(f"--lora-modules: names repeat in {lora_names}")
        if not 1 <= self.data_parallel_size <= 64:
            raise ConfigError(f"--data-parallel-size must be in 1-64, got {self.data_parallel_size}")
        if not self.time_scale > 0:
            raise ConfigError(f"--time-scale must be positive, got {self.time_scale}")
        if self.tokenize_cache_bytes < 0:
            raise ConfigError(f"--tokenize-cache-mb must be 0 (off) or more, got {self.tokenize_cache_bytes}")
        if self.default_output_tokens < 1:
            raise ConfigError(f"--default-output-tokens must be at least 1, got {self.default_output_tokens}")
        if self.kv_events is not None and self.data_parallel_size > 1:
            ports = [self.kv_events.port, self.kv_events.replay_port or 0]
            if all(ports) and abs(ports[0] - ports[1]) < self.data_parallel_size:
                raise ConfigError(
                    f"--kv-events-port {ports[0]} and --kv-replay-port {ports[1]} overlap once offset "
                    f"by {self.data_parallel_size} ranks; keep them at least that far apart"
                )

    @property
    def base_model_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)
