"""What a `serve deploy` of a changed config changes, setting by setting.

    front door only   `FRONT_DOOR_SETTINGS` (groups, ingress, caps, rollout): no engine starts
    in place          `IN_PLACE_SETTINGS` with `serving.rollout.mode: in_place`: the
                      coordinator restarts each member's engine with them, one at a time
    new gangs         any other group setting: `beside` (spare slots) or `restart`; refused
                      with `in_place`
    fixed             `FIXED_WHILE_SERVING`: only `restart` (every group at once)
"""

from __future__ import annotations

import copy
import hashlib
import json

from engram_ray.serve.settings.config import (DEFAULT_ROLLOUT_MODE, FIXED_WHILE_SERVING,
                                              FRONT_DOOR_SETTINGS, IN_PLACE_SETTINGS,
                                              KEPT_IN_GROUPS)


def changed_settings(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted paths of the settings that differ between two app-config dicts."""
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b, path = old.get(key), new.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            changed += changed_settings(a, b, path + ".")
        elif a != b:
            changed.append(path)
    return changed


def setting_paths(values: dict, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf setting of a (nested) config dict."""
    paths = []
    for key, value in values.items():
        if isinstance(value, dict):
            paths += setting_paths(value, f"{prefix}{key}.")
        else:
            paths.append(f"{prefix}{key}")
    return paths


def _under(path: str, roots) -> bool:
    return any(path == root or path.startswith(root + ".") for root in roots)


def fixed_changes(changed: list[str]) -> list[str]:
    """Those of `changed` that cannot roll (`FIXED_WHILE_SERVING`)."""
    return [path for path in changed if _under(path, FIXED_WHILE_SERVING)]


def in_place_changes(changed: list[str]) -> list[str]:
    """Those of `changed` an engine restarted in place applies (`IN_PLACE_SETTINGS`)."""
    return [path for path in changed
            if _under(path, IN_PLACE_SETTINGS) and not _under(path, KEPT_IN_GROUPS)]


def rollout_mode(app_config_dict: dict) -> str:
    rollout = (app_config_dict.get("serving") or {}).get("rollout") or {}
    return rollout.get("mode", DEFAULT_ROLLOUT_MODE)


def group_settings(app_config_dict: dict, mode: str | None = None) -> dict:
    """A front door's app-config dict without the settings only the front door reads
    (`FRONT_DOOR_SETTINGS`) and, when the rollout `mode` (default: the dict's own) is
    `in_place`, without `IN_PLACE_SETTINGS` (but `KEPT_IN_GROUPS`): what every group
    application's args hold, so that only a change of them makes Serve replace a gang."""
    mode = mode or rollout_mode(app_config_dict)
    out = copy.deepcopy(app_config_dict)
    for path in FRONT_DOOR_SETTINGS + (IN_PLACE_SETTINGS if mode == "in_place" else ()):
        section, key = path.split(".")
        values = out.get(section)
        if not isinstance(values, dict) or key not in values:
            continue
        kept = {p.split(".")[2]: values[key][p.split(".")[2]] for p in KEPT_IN_GROUPS
                if p.startswith(path + ".") and isinstance(values[key], dict)
                and p.split(".")[2] in values[key]}
        if kept:
            values[key] = kept
        else:
            del values[key]
    return out


def in_place_values(app_config_dict: dict) -> dict:
    """{setting path: value} of the `IN_PLACE_SETTINGS` of a (filled) app-config dict."""
    out = {}
    for path in IN_PLACE_SETTINGS:
        section, key = path.split(".")
        out[path] = (app_config_dict.get(section) or {}).get(key)
    return out


def config_version(app_config_dict: dict) -> str:
    """The version of the settings an engine runs with: 8 hex digits of a hash of its
    `IN_PLACE_SETTINGS` (the same for the same values, whichever coordinator computes it)."""
    text = json.dumps(in_place_values(app_config_dict), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def with_in_place_values(app_config_dict: dict, source: dict) -> dict:
    """`app_config_dict` with the `IN_PLACE_SETTINGS` of `source` (a replica's config with
    the coordinator's current engine settings)."""
    out = copy.deepcopy(app_config_dict)
    for path, value in in_place_values(source).items():
        section, key = path.split(".")
        out.setdefault(section, {})[key] = copy.deepcopy(value)
    return out
