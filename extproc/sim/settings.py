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
from extproc.sim.kv_publisher import KVEventSettings
from extproc.sim.kv_wire import EventEncoding
from extproc.types import ENGINE_KINDS, EngineKind


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
