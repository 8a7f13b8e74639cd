"""A real `ddtree serve` process on a free 127.0.0.1 port, and a chat-template checkpoint."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

from ddtree.commands._decode import DEMO_DIR
from ddtree.serve.loadgen import server_process

STARTUP_S = 180  # loading + warm-up on a loaded 2-core CI machine, generously
# A template in the spirit of the demo corpus (Python source): one comment line per message.
CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def chat_checkpoint(folder: Path) -> Path:
    """The demo target with a chat template: its files linked (weights untouched), its
    tokenizer_config.json copied with ``chat_template`` added."""
    folder.mkdir(parents=True, exist_ok=True)
    source = DEMO_DIR / "target"
    for file in source.iterdir():
        if file.name != "tokenizer_config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


@contextmanager
def running_server(tmp: Path, *args: str):
    """``ddtree serve --port 0 --threads 1 ARGS`` (a free port) until the block ends."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    stderr = tmp / "serve.stderr"
    with server_process(["--threads", "1", *args], stderr, env, timeout_s=STARTUP_S) as server:
        yield server


def wait_for(condition, what: str, timeout_s: float = 60.0, every_s: float = 0.05):
    """Poll ``condition()`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def scrape(server) -> dict[str, float]:
    """/metrics as {'name{label="v"}': value} (the samples prometheus_client parses)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
