"""The benchmark tests' way to run `pagoda bench ...` in-process: the JSON its --output-json wrote."""

import json

from deploy.cli import main as pagoda


def run_json(tmp_path, *argv) -> dict:
    out = tmp_path / "result.json"
    assert pagoda([*argv, "--output-json", str(out)]) == 0
    return json.loads(out.read_text())
