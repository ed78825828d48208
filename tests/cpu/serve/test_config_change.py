"""What a `serve deploy` of a changed config changes (`engram_ray.serve.settings.config_change`,
`rolls_out`): with `serving.rollout.mode: in_place` the engine settings are the front door's
and roll in place (data-parallel gangs too); a change that needs new gangs is refused naming
the settings; a change of the rollout alone touches no group."""

import copy

import pytest

from engram_ray.actors.coordinator_lookup import rolls_out
from engram_ray.errors import EngramRayError
from engram_ray.serve.settings.config_change import (config_version, group_settings,
                                                     in_place_changes, setting_paths,
                                                     with_in_place_values)

OLD = {"deployment": {"model": "m", "peer_group_size": 2, "rendezvous_timeout_s": 300},
       "serving": {"num_peer_groups": 1, "max_model_len": 512, "data_parallel_size": 1,
                   "engine_kwargs": {"max_num_seqs": 128, "load_format": "dummy"},
                   "rollout": {"mode": "in_place", "drain_timeout_s": 60}}}


def _with(**serving) -> dict:
    new = copy.deepcopy(OLD)
    new["serving"].update(serving)
    return new


def test_in_place_group_args_keep_what_decides_the_rows_and_drop_engine_settings():
    groups = group_settings(OLD)
    assert groups["serving"] == {"data_parallel_size": 1,
                                 "engine_kwargs": {"load_format": "dummy"}}
    beside = group_settings(_with(rollout={"mode": "beside"}))
    assert beside["serving"]["engine_kwargs"] == OLD["serving"]["engine_kwargs"]
    assert beside["serving"]["max_model_len"] == 512 and "rollout" not in beside["serving"]
    assert in_place_changes(setting_paths(OLD)) == [
        "serving.max_model_len", "serving.engine_kwargs.max_num_seqs"]


def test_an_engine_setting_rolls_in_place_and_changes_the_settings_version():
    new = _with(engine_kwargs={"max_num_seqs": 96, "load_format": "dummy"})
    assert rolls_out(OLD, new, "d")
    assert group_settings(new) == group_settings(OLD)  # Serve rebuilds no group
    assert config_version(new) != config_version(OLD)
    assert config_version(copy.deepcopy(new)) == config_version(new)
    back = with_in_place_values({"serving": {"max_model_len": 1, "device": "cpu"}}, new)
    assert back["serving"]["engine_kwargs"]["max_num_seqs"] == 96
    assert back["serving"]["device"] == "cpu" and back["serving"]["max_model_len"] == 512


def test_a_change_of_the_rollout_alone_is_the_front_doors():
    new = _with(rollout={"mode": "in_place", "drain_timeout_s": 5})
    assert rolls_out(OLD, new, "d")
    assert group_settings(new) == group_settings(OLD)
    assert config_version(new) == config_version(OLD)  # no engine restarts


def test_in_place_refuses_a_change_that_needs_new_gangs_naming_it():
    new = copy.deepcopy(OLD)
    new["deployment"]["rendezvous_timeout_s"] = 600
    with pytest.raises(EngramRayError, match=r"change of deployment.rendezvous_timeout_s needs "
                                             r"new gangs.*rollout.mode: beside"):
        rolls_out(OLD, new, "d")
    new["serving"]["rollout"] = {"mode": "beside"}
    assert rolls_out(OLD, new, "d")


def test_engine_settings_of_data_parallel_gangs_roll_in_place():
    """DEP2 (every shipped GPU config): a DP gang's engines restart in place together."""
    old = _with(data_parallel_size=2)
    new = copy.deepcopy(old)
    new["serving"]["max_model_len"] = 1024
    assert rolls_out(old, new, "d") is True
    assert group_settings(old, "in_place") == group_settings(new, "in_place")


def test_the_rows_never_roll():
    new = _with(engine_kwargs={"max_num_seqs": 128})  # load_format dummy -> checkpoint
    with pytest.raises(EngramRayError, match="serving.engine_kwargs.load_format cannot roll"):
        rolls_out(OLD, new, "d")
