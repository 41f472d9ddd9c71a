"""``python scripts/uv_pip.py UV [install args]``: ``UV pip install`` into this Python's environment
with the settings pip has here (scripts/dev.sh's installer when uv could be installed).

uv reads no pip configuration, so the settings ``pip config list`` shows (pip.conf files and
PIP_* variables; a variable over an ``[install]`` value over a ``[global]`` one) are passed on:
indexes, find-links, constraints, trusted hosts, pre-releases as options; the certificate
bundle, the timeout and the proxy as the variables uv reads (where not set already). As pip
does, uv then takes the best version any index or find-links location offers
(``--index-strategy unsafe-best-match``), not the first index's.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

_SECTIONS = ("global", "install", ":env:")
"""pip's precedence, lowest first."""


def pip_settings() -> dict[str, str]:
    """``pip config list`` of this Python's pip, as one dict of the effective values."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=False).stdout
    found: dict[str, dict[str, str]] = {s: {} for s in _SECTIONS}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not sep or not dot or section not in found:
            continue
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        found[section][key.replace("_", "-")] = str(value)
    merged: dict[str, str] = {}
    for section in _SECTIONS:
        merged.update(found[section])
    return merged


def _true(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def uv_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's options and environment variables for pip's ``settings``."""
    args = ["--index-strategy", "unsafe-best-match"]
    env: dict[str, str] = {}
    for key, value in settings.items():
        words = value.split()
        if key == "index-url":
            args += ["--index-url", value]
        elif key == "extra-index-url":
            args += [a for url in words for a in ("--extra-index-url", url)]
        elif key == "find-links":
            args += [a for where in words for a in ("--find-links", where)]
        elif key == "constraint":
            args += [a for path in words for a in ("--constraint", path)]
        elif key == "trusted-host":
            args += [a for host in words for a in ("--allow-insecure-host", host)]
        elif key == "no-index" and _true(value):
            args.append("--no-index")
        elif key == "pre" and _true(value):
            args += ["--prerelease", "allow"]
        elif key == "cert":
            env["SSL_CERT_FILE"] = value
        elif key == "client-cert":
            env["SSL_CLIENT_CERT"] = value
        elif key in ("timeout", "default-timeout"):
            env["UV_HTTP_TIMEOUT"] = value
        elif key == "proxy":
            env["HTTPS_PROXY"] = env["HTTP_PROXY"] = value
    return args, env


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    uv, *rest = argv
    args, env = uv_options(pip_settings())
    env = {**env, **os.environ}  # what the caller set wins
    return subprocess.run([uv, "pip", "install", "--python", sys.executable, *args, *rest], env=env,
                          check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
