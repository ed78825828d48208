"""What a `serve deploy` of a changed config changes, setting by setting: the coordinator rolls
a change out group by group (`serving.rollout`) unless it touches a setting old and new
engines cannot serve side by side with (`FIXED_WHILE_SERVING`)."""

from __future__ import annotations

from engram_ray.serve.config import FIXED_WHILE_SERVING, FRONT_DOOR_SETTINGS


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


def fixed_changes(changed: list[str]) -> list[str]:
    """Those of `changed` that cannot roll (`FIXED_WHILE_SERVING`)."""
    return [path for path in changed
            if any(path == fixed or path.startswith(fixed + ".") for fixed in FIXED_WHILE_SERVING)]


def group_settings(app_config_dict: dict) -> dict:
    """An app-config dict without the settings only the front door reads
    (`FRONT_DOOR_SETTINGS`): what every group application's engines run with."""
    import copy

    out = copy.deepcopy(app_config_dict)
    for path in FRONT_DOOR_SETTINGS:
        section, key = path.split(".")
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    return out
