"""The Serve app config as pydantic models: unknown keys and bad values refused naming the path
of the field, frozen sections that round-trip through dicts, and `serving.ingress`."""

import pytest

from engram_ray.errors import ConfigError
from engram_ray.serve.settings.config import IngressConfig, ServeAppConfig, ServingConfig


@pytest.mark.parametrize("args,message", [
    ({"serving": {"num_peer_groups": 0}},
     "args: serving: num_peer_groups: is 0 (expected an integer >= 1)"),
    ({"serving": {"ingress": {"num_replica": 3}}},
     "args: serving: ingress: num_replica: is not a known setting (expected one of "
     "autoscaling_config, num_replicas)"),
    ({"serving": {"request_limits": {"max_n": True}}},
     "args: serving: request_limits: max_n: is True (expected an integer >= 1)"),
    ({"serving": {"enable_expert_parallel": "yes"}},
     "args: serving: enable_expert_parallel: is 'yes' (expected true or false)"),
    ({"serving": {"metrics_port": 70000}},
     "args: serving: metrics_port: is 70000 (expected an integer >= 0 and <= 65535)"),
    ({"deployment": {"max_peer_groups": 2}},
     "args: deployment: max_peer_groups: is no longer a setting (expected serving."
     "num_peer_groups"),
    ({"deploymnet": {}}, "args: deploymnet: is not a known setting (expected one of deployment, "
                         "serving)"),
    ({"serving": None, "deployment": "x"}, "args: deployment: is str (expected a mapping"),
])
def test_errors_name_the_path_of_the_field(args, message):
    with pytest.raises(ConfigError) as info:
        ServeAppConfig.from_dict(args, "args")
    assert str(info.value).startswith(message)


def test_sections_are_frozen_and_round_trip_as_dicts():
    app = ServeAppConfig.from_dict({"serving": {"ingress": {"autoscaling_config": {
        "min_replicas": 2, "max_replicas": 8}}, "request_limits": {"max_n": 2}}})
    assert ServeAppConfig.from_dict(app.to_dict()) == app == ServeAppConfig(**app.to_dict())
    assert app.serving.request_limits.max_n == 2
    with pytest.raises(ValueError, match="frozen"):
        app.serving.ingress.num_replicas = 3
    assert app.replace(serving=app.serving.replace(num_peer_groups=2)).num_replicas == 16


def test_ingress_has_two_replicas_or_autoscaling():
    assert ServingConfig().ingress == IngressConfig(num_replicas=2, autoscaling_config=None)
    assert IngressConfig(num_replicas=3).num_replicas == 3
    auto = IngressConfig(autoscaling_config={"min_replicas": 2, "max_replicas": 6})
    assert auto.num_replicas == 2  # left out: autoscaling decides
    with pytest.raises(ConfigError) as info:
        IngressConfig(num_replicas=4, autoscaling_config={"max_replicas": 6})
    assert str(info.value).startswith("num_replicas: is 4 while autoscaling_config is set")
    with pytest.raises(ConfigError, match="num_replicas: is 0"):
        IngressConfig(num_replicas=0)


def test_ingress_autoscaling_keys_are_serves():
    from engram_ray.serve.settings.library_options import check_llm_options

    app = ServeAppConfig.from_dict({"serving": {"ingress": {"autoscaling_config": {
        "min_replicas": 2, "max_replica": 6}}}})
    with pytest.raises(ConfigError) as info:
        check_llm_options(app.serving)
    assert str(info.value) == ("serving.ingress.autoscaling_config.max_replica: is not an "
                               "option there (expected `max_replicas`)")
