"""Deployment config: one frozen dataclass per section, validated on construction.

YAML (or a dict) reaches it through `DeploymentConfig.from_dict`, which rejects unknown keys by
name. Adding a setting = adding a field with a `_field(default, "description")` and, if it needs
one, a check in `__post_init__`; a nested section = a field whose type is another dataclass with
its own `from_dict` (see `_build_section`), so later sections (serving) extend this file additively.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

from engram_ray.errors import ConfigError
from engram_ray.tables import BACKENDS, FILLS

DEFAULT_DOMAIN_LABEL_KEY = "engram.io/nvlink-domain"


def _field(default, doc: str):
    """A dataclass field with its description (shown by `describe_fields`)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


def _check_number(name: str, value, *, minimum: float, integer: bool = False,
                  exclusive: bool = False) -> None:
    types = (int,) if integer else (int, float)
    is_number = isinstance(value, types) and not isinstance(value, bool)
    too_small = is_number and (value <= minimum if exclusive else value < minimum)
    if not is_number or too_small:
        kind = "an integer" if integer else "a number"
        bound = f"> {minimum}" if exclusive else f">= {minimum}"
        raise ConfigError(name, f"is {value!r}", f"{kind} {bound}")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(name, f"is {value!r}", f"one of {', '.join(choices)}")


def _check_text(name: str, value, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        raise ConfigError(name, f"is {value!r}", "a non-empty string")


class _Section:
    """Shared construction of config sections from plain dicts (YAML)."""

    # Settings that are gone, with what to use instead (refused by name, not silently kept).
    RETIRED: typing.ClassVar[dict[str, str]] = {}

    @classmethod
    def from_dict(cls, data, source: str = "config"):
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(source, f"is {type(data).__name__}", "a mapping of settings")
        retired = sorted(set(data) & set(cls.RETIRED))
        if retired:
            raise ConfigError(f"{source}: {retired[0]}", "is no longer a setting",
                              cls.RETIRED[retired[0]])
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"{source}: {unknown[0]}", "is not a known setting",
                              f"one of {', '.join(sorted(known))}")
        hints = typing.get_type_hints(cls)
        kwargs = {key: _build_section(hints[key], value, f"{source}: {key}")
                  for key, value in data.items()}
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def describe_fields(cls) -> dict[str, str]:
        """Setting name -> description, for docs and `--help` texts."""
        return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def _build_section(hint, value, source: str):
    if isinstance(hint, type) and issubclass(hint, _Section):
        return hint.from_dict(value, source)
    return value


@dataclass(frozen=True)
class DeploymentConfig(_Section):
    """Where the Engram tables of one deployment live and how their peer groups are formed."""

    RETIRED: typing.ClassVar[dict[str, str]] = {
        "max_peer_groups": "serving.num_peer_groups (exactly that many groups serve; the "
                           "build fails naming what is missing when they do not fit)",
        "seed": "serving.engine_kwargs.load_format 'dummy' for synthetic rows (vLLM's dummy "
                "weights fill the tables; there is no seed of their own)"}

    name: str = _field("engram", "deployment name: prefix of actor names and store folders")
    model: str = _field("deepseek-v4.1-flash",
                        "model preset name or path to a config.json (or its folder)")
    peer_group_size: int = _field(8, "GPUs (engines) that split each table's rows; every "
                                     "group lies inside one NVLink domain")
    peer_group_store: str = _field(
        "/tmp/engram-ray/store",
        "root folder of the rendezvous stores (one 0700 folder per group and generation); "
        "must be one shared path for every host of a multi-host NVLink domain")
    table_backend: str = _field("cuda", "peer memory backend: 'cuda' (HBM slices, CUDA VMM "
                                        "handles) or 'shm' (host shared memory, CPU tests)")
    handle_type: str | None = _field(
        None, "CUDA handle type of the slices: 'fabric' (IMEX; the only one across hosts), "
              "'posix_fd' (one host), or unset: each group picks the first every member can use "
              "(table_backend cuda only)")
    fill: str = _field("synthetic", "table contents: 'synthetic' (deterministic rows) or "
                                    "'checkpoint' (the model's Engram weights)")
    checkpoint: str | None = _field(None, "checkpoint folder when fill is 'checkpoint'")
    rendezvous_timeout_s: float = _field(300.0, "seconds a group's members wait for each "
                                                "other at startup before failing")
    placement_timeout_s: float = _field(120.0, "seconds the application's build waits for "
                                               "every peer group to have room in one NVLink "
                                               "domain before failing with what is missing")
    health_check_interval_s: float = _field(
        1.0, "seconds between Serve's health checks of each engine")
    max_missed_pings: int = _field(5, "health-check intervals one check may take before it "
                                      "counts as failed (Serve then restarts the engine's "
                                      "whole group; a dead actor is noticed at once)")
    domain_label_key: str = _field(DEFAULT_DOMAIN_LABEL_KEY,
                                   "Ray node label naming a node's NVLink domain "
                                   "(set by `ray start --labels` from `engram-ray node-labels`)")
    num_cpus_per_engine: float = _field(1.0, "CPUs reserved per engine (in its bundle)")
    num_gpus_per_engine: int = _field(1, "GPUs per engine: 1, or 0 for engines on CPU (then "
                                         "a bundle is {'CPU': num_cpus_per_engine} and a "
                                         "domain is one node)")

    def __post_init__(self):
        for name in ("name", "model", "peer_group_store", "domain_label_key"):
            _check_text(name, getattr(self, name))
        _check_text("checkpoint", self.checkpoint, optional=True)
        _check_number("peer_group_size", self.peer_group_size, minimum=1, integer=True)
        _check_number("max_missed_pings", self.max_missed_pings, minimum=1, integer=True)
        for name in ("rendezvous_timeout_s", "placement_timeout_s", "health_check_interval_s"):
            _check_number(name, getattr(self, name), minimum=0, exclusive=True)
        _check_number("num_cpus_per_engine", self.num_cpus_per_engine, minimum=0)
        _check_choice("table_backend", self.table_backend, tuple(BACKENDS))
        if self.handle_type is not None:
            from engram_ray.tables.backends.handle_types import HANDLE_TYPES
            _check_choice("handle_type", self.handle_type, HANDLE_TYPES)
            if self.table_backend != "cuda":
                raise ConfigError("handle_type", f"is {self.handle_type!r} with table_backend "
                                  f"{self.table_backend!r}", "unset: handle types are CUDA's "
                                  "(table_backend cuda)")
        _check_choice("fill", self.fill, FILLS)
        if self.num_gpus_per_engine not in (0, 1) or isinstance(self.num_gpus_per_engine, bool):
            raise ConfigError("num_gpus_per_engine", f"is {self.num_gpus_per_engine!r}",
                              "1 (one engine per GPU) or 0 (engines on CPU)")
        if self.num_gpus_per_engine == 0 and self.num_cpus_per_engine <= 0:
            raise ConfigError("num_cpus_per_engine", f"is {self.num_cpus_per_engine!r} with "
                              "num_gpus_per_engine 0", "> 0: a CPU engine's bundle is its CPUs")
        if self.table_backend == "cuda" and self.num_gpus_per_engine == 0:
            raise ConfigError("table_backend", "is 'cuda' with num_gpus_per_engine 0",
                              "'shm' for engines on CPU, or num_gpus_per_engine 1")
        if self.fill == "checkpoint" and self.checkpoint is None:
            raise ConfigError("checkpoint", "is missing while fill is 'checkpoint'",
                              "the checkpoint folder holding the Engram weights")
        if self.fill != "checkpoint" and self.checkpoint is not None:
            # Otherwise the tables would silently hold synthetic rows, not these weights.
            raise ConfigError("checkpoint", f"is {self.checkpoint!r} while fill is {self.fill!r}",
                              "fill: checkpoint to load it, or no checkpoint for synthetic rows")

    @property
    def table_device(self) -> str:
        """Device of the table slices: HBM for the cuda backend, host memory for shm."""
        return "cuda" if self.table_backend == "cuda" else "cpu"

    @property
    def is_cpu_only(self) -> bool:
        return self.num_gpus_per_engine == 0

    @property
    def bundle(self) -> dict[str, float]:
        """Resources of one engine's placement-group bundle."""
        if self.is_cpu_only:
            return {"CPU": float(self.num_cpus_per_engine)}
        bundle = {"GPU": float(self.num_gpus_per_engine)}
        if self.num_cpus_per_engine > 0:
            bundle["CPU"] = float(self.num_cpus_per_engine)
        return bundle

    def replace(self, **changes) -> "DeploymentConfig":
        return dataclasses.replace(self, **changes)


def load_deployment_config(path: str) -> DeploymentConfig:
    """Read a deployment YAML file (a mapping of settings) into a `DeploymentConfig`."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ConfigError("deployment config", f"{path!r} is not a file",
                          "a path to a deployment YAML")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(str(file), f"is not valid YAML ({exc})", "a mapping of settings") from None
    return DeploymentConfig.from_dict(data, str(file))
