"""`engram-ray config schema`: a JSON schema of the Serve app args that the project's own Serve
YAMLs (and KubeRay's embedded ones) pass and a typo fails; `engram-ray config tables`: the
settings tables of a markdown file written from the models, a stale one found by `--check`."""

import json
from pathlib import Path

import pytest
import yaml

from engram_ray.cli import main

CONFIGS = Path(__file__).resolve().parents[3] / "cluster_configs"


def app_args():
    """(file, args) of every engram-ray application in cluster_configs/."""
    for path in sorted(CONFIGS.glob("serve_*.yaml")):
        for app in yaml.safe_load(path.read_text())["applications"]:
            yield path.name, app.get("args") or {}
    for path in sorted((CONFIGS / "kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "RayService":
                for app in yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]:
                    yield path.name, app.get("args") or {}


@pytest.fixture(scope="module")
def schema():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["config", "schema"]) == 0
    return json.loads(out.getvalue())


def test_schema_names_every_section_and_description(schema):
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert set(schema["properties"]) == {"deployment", "serving", "group"}
    defs = schema["$defs"]
    assert {"DeploymentConfig", "ServingConfig", "RequestLimits", "IngressConfig"} <= set(defs)
    for name, section in defs.items():
        assert section["additionalProperties"] is False, name
        for field, spec in section["properties"].items():
            assert len(spec.get("description", "")) > 10, f"{name}.{field}"
    ingress = defs["IngressConfig"]["properties"]
    assert ingress["num_replicas"]["default"] == 2 and ingress["num_replicas"]["minimum"] == 1


def test_schema_passes_the_projects_serve_yamls_and_fails_a_typo(schema):
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(schema)
    validator.check_schema(schema)
    checked = list(app_args())
    assert len(checked) >= 4
    for name, args in checked:
        assert not [e.message for e in validator.iter_errors(args)], name
    assert any("group" in args for _, args in checked)  # the groups' applications too
    errors = [e.message for e in validator.iter_errors(
        {"deployment": {"peer_group_sise": 8}, "serving": {"ingress": {"num_replicas": 0}},
         "group": "first"})]
    assert any("does not match '^group-[0-9]+$'" in e for e in errors), errors
    assert any("'peer_group_sise' was unexpected" in e for e in errors), errors
    assert any("less than the minimum of 1" in e for e in errors), errors


def test_tables_are_written_into_a_file_and_checked(tmp_path, capsys):
    from engram_ray.commands.config import MARKER, settings_tables

    tables = settings_tables()
    doc = tmp_path / "settings.md"
    body = [f"{MARKER.format(name)}\n| field | default | meaning |\n| --- | --- | --- |\n"
            "| `old` | `1` | gone |" for name in tables]
    doc.write_text("# Settings\n\n" + "\n\nprose\n\n".join(body) + "\n\nthe end\n")
    assert main(["config", "tables", str(doc), "--check"]) == 1
    out = capsys.readouterr().out
    assert all(f"the table of {name} differs" in out for name in tables), out
    assert "`old`" in doc.read_text()  # --check wrote nothing
    assert main(["config", "tables", str(doc)]) == 0
    text = doc.read_text()
    assert "`old`" not in text and text.count("\n\nprose\n\n") == len(tables) - 1
    assert text.startswith("# Settings\n\n") and text.endswith("\n\nthe end\n")
    for table in tables.values():
        assert table in text
    assert "| `num_replicas` | `2` | the OpenAI ingress replicas" in tables["serving.ingress"]
    assert "| `autoscaling_config` | unset |" in tables["serving.ingress"]
    assert main(["config", "tables", str(doc), "--check"]) == 0


def test_tables_keep_what_surrounds_them(tmp_path):
    """A blank line between marker and table, text right after a table, CRLF line ends: the
    table alone is replaced, everything else written back as it was."""
    from engram_ray.commands.config import MARKER, settings_tables

    tables = settings_tables()
    parts = [f"{MARKER.format(name)}\n\n| `old` | `1` | gone |\nright after {name}"
             for name in tables]
    doc = tmp_path / "settings.md"
    doc.write_bytes("\n\n".join(parts).replace("\n", "\r\n").encode())
    assert main(["config", "tables", str(doc)]) == 0
    text = doc.read_bytes().decode()
    assert "`old`" not in text and "\n" not in text.replace("\r\n", "")
    for name, table in tables.items():
        assert (f"{MARKER.format(name)}\r\n\r\n" + table.replace("\n", "\r\n")
                + f"\r\nright after {name}") in text
    assert main(["config", "tables", str(doc), "--check"]) == 0


def test_tables_name_a_missing_marker_and_a_missing_file(tmp_path, capsys):
    from engram_ray.commands.config import MARKER, settings_tables

    doc = tmp_path / "settings.md"
    doc.write_text("<!-- settings: deployment -->\n| field |\n")
    every = "\n\n".join(MARKER.format(name) + "\n| field |" for name in settings_tables())
    for text, args, error in (
            (None, [str(doc)], "has the line '<!-- settings: serving -->' 0 times (once: the "
                               "line before the table of serving)"),
            (every + "\n\n<!-- settings: serving.ingress -->\n| field |", [str(doc), "--check"],
             "has the line '<!-- settings: serving.ingress -->' 2 times"),
            (every + "\n\n<!-- settings: servng -->", [str(doc)],
             "has '<!-- settings: servng -->', a marker of no section"),
            (None, [str(tmp_path / "missing.md")], "missing.md' is not a file"),
            (None, ["--check"], "--check needs the FILE to check")):
        if text is not None:
            doc.write_text(text)
        before = doc.read_text()
        assert main(["config", "tables", *args]) == 2
        assert error in capsys.readouterr().err
        assert doc.read_text() == before  # nothing written
