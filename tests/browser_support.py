"""What the browser tests share: Debian's chromium driven by Playwright, never a downloaded browser.

Importing this module skips the importing test module, loudly, when the playwright package or
/usr/bin/chromium is missing (`make test` installs chromium with apt-get). The `browser` fixture
(one chromium for the session) is in conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
SCREENSHOTS = Path(__file__).resolve().parent.parent / "build" / "screenshots"

try:
    from playwright.sync_api import sync_playwright  # noqa: F401  (the browser fixture uses it)
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip("BROWSER TESTS SKIPPED: the 'playwright' Python package is not installed "
                "(pip install -e '.[browser-tests]'); no browser is downloaded", allow_module_level=True)
if not CHROMIUM.is_file():  # pragma: no cover - depends on the machine
    pytest.skip(f"BROWSER TESTS SKIPPED: {CHROMIUM} is missing (apt-get install chromium); "
                "no browser is downloaded", allow_module_level=True)



def write_safetensors(folder: Path, tensors: dict, config: dict | None = None) -> Path:
    """A one-file safetensors checkpoint in `folder` (made by the safetensors library), with a config.json."""
    import json

    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder
