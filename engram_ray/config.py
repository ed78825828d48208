"""Deployment config: one frozen pydantic model per section, validated on construction.

YAML (or a dict) reaches a section through `from_dict(data, source)`; every failure, pydantic's
or a section's own check, is one `ConfigError` naming the path of the field at fault
(`source: section: field`) and what was expected. Adding a setting = adding a field with a
`Field(default, description=...)` (its type and bounds are checked and go into the JSON schema,
`engram-ray config schema`) and, if it needs one, a check in the section's `_check`, then
`engram-ray config tables README.md` (the README's settings tables; a test compares them); a
nested section = a field whose type is another `Section` (see `engram_ray.serve.settings.config`).
"""

from types import NoneType, UnionType
from typing import Annotated, ClassVar, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, MinLen
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engram_ray.errors import ConfigError
from engram_ray.tables import BACKENDS, FILLS
from engram_ray.tables.backends.handle_types import HANDLE_TYPES

DEFAULT_DOMAIN_LABEL_KEY = "engram.io/nvlink-domain"

# Field types with their bounds: the bounds are checked, shown in the schema, and named in errors.
Text = Annotated[str, MinLen(1)]
Count = Annotated[int, Ge(1)]
Seconds = Annotated[float, Gt(0)]
Amount = Annotated[float, Ge(0)]
Port = Annotated[int, Ge(0), Le(65535)]
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
          dict: "a mapping"}
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="))


class Section(BaseModel):
    """A config section: frozen, strict (`True` is not a count, `"8"` not a number), unknown
    keys refused by name, its own checks in `_check`."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", protected_namespaces=())

    # Settings that are gone, with what to use instead (refused by name, not silently kept).
    RETIRED: ClassVar[dict[str, str]] = {}
    # Field -> what an error about its value says is expected, where the type alone says too little.
    EXPECTED: ClassVar[dict[str, str]] = {}

    def __init__(self, /, **data):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error(exc, type(self)) from None

    @classmethod
    def from_dict(cls, data, source: str = "config"):
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise config_error(exc, cls, source) from None

    def to_dict(self) -> dict:
        return self.model_dump()

    def replace(self, **changes):
        """A copy with `changes`, validated again as a whole."""
        return type(self)(**{**self.__dict__, **changes})

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data):
        if isinstance(data, BaseModel):
            return data
        data = {} if data is None else data  # a YAML key with nothing after it: the defaults
        if not isinstance(data, dict):
            raise ConfigError("", f"is {type(data).__name__}", "a mapping of settings")
        for key in sorted(data, key=str):
            if key in cls.RETIRED:
                raise ConfigError(str(key), "is no longer a setting", cls.RETIRED[key])
            if key not in cls.model_fields:
                raise ConfigError(str(key), "is not a known setting",
                                  f"one of {', '.join(sorted(cls.model_fields))}")
        return cls._fill_in(data)

    @classmethod
    def _fill_in(cls, data: dict) -> dict:
        """Settings derived from others where left out (`ServeAppConfig`)."""
        return data

    @model_validator(mode="after")
    def _after(self):
        self._check()
        return self

    def _check(self) -> None:
        """Checks across fields; raise `ConfigError` naming the field (relative to the section)."""


def config_error(exc: ValidationError, model: type[Section], source: str | None = None):
    """The first error of `exc` as a `ConfigError` naming `source: section: field`."""
    error = exc.errors(include_url=False)[0]
    path, owner, info = [], model, None
    for part in error["loc"]:  # section and field names; stops at a union member's tag
        if not (isinstance(owner, type) and part in getattr(owner, "model_fields", {})):
            break
        section, info = owner, owner.model_fields[part]
        path.append(str(part))
        owner = info.annotation
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # a section's own check, named relative to the section
        field, problem, expected = cause.field, cause.problem, cause.expected
    else:
        field, problem = "", f"is {error['input']!r}"
        expected = (section.EXPECTED.get(path[-1]) or _expected(info.annotation, info.metadata)
                    if info else error["msg"])
    return ConfigError(": ".join(p for p in (source, *path, field) if p), problem, expected)


def _expected(annotation, metadata=()) -> str:
    """`int` with Ge(1) -> "an integer >= 1"; unions joined by "or"; Optional: ", or unset"."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _expected(args[0], args[1:])
    if origin is Literal:
        return " or ".join(repr(a) for a in args)
    if origin in (Union, UnionType):
        text = " or ".join(_expected(a) for a in args if a is not NoneType)
        return text + (", or unset" if NoneType in args else "")
    if annotation is str and any(isinstance(m, MinLen) for m in metadata):
        return "a non-empty string"
    bounds = [f"{sign} {getattr(m, attr)}" for m in metadata for attr, sign in _BOUNDS
              if hasattr(m, attr)]
    kind = _KINDS.get(annotation, getattr(annotation, "__name__", str(annotation)))
    return " ".join([kind, " and ".join(bounds)]).strip()


class DeploymentConfig(Section):
    """Where the Engram tables of one deployment live and how their peer groups are formed."""

    RETIRED: ClassVar[dict[str, str]] = {
        "max_peer_groups": "serving.num_peer_groups (exactly that many groups serve; the "
                           "build fails naming what is missing when they do not fit)",
        "seed": "serving.engine_kwargs.load_format 'dummy' for synthetic rows (vLLM's dummy "
                "weights fill the tables; there is no seed of their own)"}
    EXPECTED: ClassVar[dict[str, str]] = {
        "num_gpus_per_engine": "1 (one engine per GPU) or 0 (engines on CPU)"}

    name: Text = Field("engram", description=(
        "deployment name: prefix of actor names and store folders"))
    model: Text = Field("deepseek-v4.1-flash", description=(
        "model preset name or path to a config.json (or its folder)"))
    peer_group_size: Count = Field(8, description=(
        "GPUs (engines) that split each table's rows; every group lies inside one NVLink domain"))
    peer_group_store: Text = Field("/tmp/engram-ray/store", description=(
        "root folder of the rendezvous stores (one 0700 folder per group and generation); must be "
        "one shared path for every host of a multi-host NVLink domain"))
    table_backend: Literal[tuple(BACKENDS)] = Field("cuda", description=(
        "peer memory backend: 'cuda' (HBM slices, CUDA VMM handles) or 'shm' (host shared memory, "
        "CPU tests)"))
    handle_type: Literal[HANDLE_TYPES] | None = Field(None, description=(
        "CUDA handle type of the slices: 'fabric' (IMEX; the only one across hosts), 'posix_fd' "
        "(one host), or unset: each group picks the first every member can use (table_backend "
        "cuda only)"))
    fill: Literal[FILLS] = Field("synthetic", description=(
        "table contents: 'synthetic' (deterministic rows) or 'checkpoint' (the model's Engram "
        "weights); in a Serve app left out: `checkpoint` (`synthetic` with `load_format: dummy`)"))
    checkpoint: Text | None = Field(None, description=(
        "checkpoint folder when fill is 'checkpoint'; in a Serve app left out: "
        "`serving.model_source`"))
    rendezvous_timeout_s: Seconds = Field(300.0, description=(
        "seconds a group's members wait for each other at startup before failing"))
    placement_timeout_s: Seconds = Field(120.0, description=(
        "seconds the application's build waits for every peer group to have room in one NVLink "
        "domain before failing with what is missing"))
    replace_lost_group_after_s: Seconds | None = Field(30.0, description=(
        "seconds a group's NVLink domain may be lost (its nodes dead or gone) before the group "
        "is placed again in another domain with room (only its own deployment restarts; "
        "`serve deploy` applications); null: a group waits for its domain"))
    health_check_interval_s: Seconds = Field(1.0, description=(
        "seconds between Serve's health checks of each engine"))
    max_missed_pings: Count = Field(5, description=(
        "health-check intervals one check may take before it counts as failed (Serve then "
        "restarts the engine's whole group; a dead actor is noticed at once)"))
    domain_label_key: Text = Field(DEFAULT_DOMAIN_LABEL_KEY, description=(
        "Ray node label naming a node's NVLink domain (set by `ray start --labels` from "
        "`engram-ray node-labels`)"))
    num_cpus_per_engine: Amount = Field(1.0, description="CPUs reserved per engine (in its bundle)")
    num_gpus_per_engine: Literal[0, 1] = Field(1, description=(
        "GPUs per engine: 1, or 0 for engines on CPU (then a bundle is {'CPU': "
        "num_cpus_per_engine} and a domain is one node)"))

    def _check(self) -> None:
        if self.handle_type is not None and self.table_backend != "cuda":
            raise ConfigError("handle_type", f"is {self.handle_type!r} with table_backend "
                              f"{self.table_backend!r}", "unset: handle types are CUDA's "
                              "(table_backend cuda)")
        if self.is_cpu_only and self.num_cpus_per_engine <= 0:
            raise ConfigError("num_cpus_per_engine", f"is {self.num_cpus_per_engine:g} with "
                              "num_gpus_per_engine 0", "> 0: a CPU engine's bundle is its CPUs")
        if self.table_backend == "cuda" and self.is_cpu_only:
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

