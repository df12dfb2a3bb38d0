"""Where a Hugging Face ``model=``/``tokenizer=`` comes from, checked in seconds instead of a minute of retries.

A value that exists on this machine is a local directory and needs nothing else. Any other value that looks like a
Hub repo id (``gpt2``, ``Qwen/Qwen2.5-0.5B``) is fetched from the Hub by ``from_pretrained``, which, when the Hub
cannot be reached, retries for over a minute and then fails with a traceback in every replica. ``check_source``
answers first, once per process: a copy in the Hugging Face cache is used as it is (``cache_only``: load it with
``local_files_only``); otherwise, with ``HF_HUB_OFFLINE=1`` or a Hub that does not answer one request within
``PROBE_TIMEOUT_S``, it raises a one-line ``ConfigError`` naming the field and the fix (a local
``save_pretrained`` directory, which docs/trainers.md shows how to build offline).

The probe is one ``HEAD`` of the Hub's model listing at ``HF_ENDPOINT`` (default ``https://huggingface.co``), through
the environment's proxy settings, in a daemon thread joined with a deadline, so that a name lookup that hangs is
bounded too. Any HTTP answer, even 401 or 404, means the Hub is reachable: ``from_pretrained`` then explains a
private or misspelt repo itself. Only ``huggingface_hub`` (for the cache lookup) is imported, and only for a Hub
name: the launcher runs this before any replica starts.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Literal

from diloco.errors import ConfigError

#: How long one reachability probe of the Hub may take (a reachable Hub answers a HEAD in well under a second).
PROBE_TIMEOUT_S = 5.0
DEFAULT_ENDPOINT = "https://huggingface.co"
#: What ``from_pretrained`` reads first for each kind of source: one of them in the cache is a usable copy.
CACHE_FILES = {"model": ("config.json",), "tokenizer": ("tokenizer_config.json", "tokenizer.json")}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_TRUE = {"1", "on", "yes", "true"}

Field = Literal["model", "tokenizer"]


@dataclass(frozen=True)
class Source:
    """Where ``from_pretrained`` will find ``name``: a local directory, the Hub, or the cache alone."""

    name: str
    kind: Literal["directory", "hub", "cache"]

    @property
    def cache_only(self) -> bool:
        return self.kind == "cache"


def check_source(field: Field, name: str) -> Source:
    """``name`` (the value of ``-k FIELD=``) resolved, or a ``ConfigError`` naming ``field`` when
    ``from_pretrained`` could only fail: a path that does not exist, or a Hub name neither cached nor reachable."""
    if os.path.exists(os.path.expanduser(name)):
        return Source(name, "directory")
    if not looks_like_repo_id(name):
        raise ConfigError(f"{field}: {name!r} is not a local directory (no such path here) nor a Hub repo id",
                          hint=f"pass an existing save_pretrained directory, e.g. -k {field}=./my-{field}, or a "
                               "Hub name such as gpt2")
    if in_cache(name, field):
        return Source(name, "cache" if offline() or hub_unreachable() is not None else "hub")
    fix = (f"pass a local save_pretrained directory, e.g. -k {field}=./my-{field}"
           + (": docs/trainers.md, 'Without the Hub', builds one offline in a few lines" if field == "tokenizer" else "")
           + "; or fill the Hugging Face cache where the Hub is reachable")
    if offline():
        raise ConfigError(f"{field}: {name!r} is not a local directory, HF_HUB_OFFLINE=1 is set and the Hugging "
                          f"Face cache ({cache_dir()}) has no copy", hint=fix)
    reason = hub_unreachable()
    if reason is not None:
        raise ConfigError(f"{field}: {name!r} is not a local directory, the Hugging Face Hub ({endpoint()}) "
                          f"cannot be reached from this machine ({reason}) and the cache has no copy", hint=fix)
    return Source(name, "hub")


def looks_like_repo_id(name: str) -> bool:
    """``org/name`` or ``name`` as the Hub spells repo ids; a path (``./x``, ``/x``, ``~/x``, ``a/b/c``) is not."""
    return bool(_REPO_ID.match(name)) and ".." not in name


def offline() -> bool:
    """Whether the user asked the Hugging Face libraries never to reach the Hub."""
    return any(os.environ.get(var, "").strip().lower() in _TRUE for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def in_cache(name: str, field: Field) -> bool:
    """Whether the Hugging Face cache holds a download of ``name`` that ``from_pretrained`` can load offline."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return any(isinstance(try_to_load_from_cache(name, filename), str) for filename in CACHE_FILES[field])


def hub_unreachable() -> str | None:
    """Why the Hub does not answer (``None`` when it does), from one bounded probe per endpoint and process."""
    return _probe(endpoint())


@functools.lru_cache(maxsize=8)
def _probe(base: str) -> str | None:
    outcome: list[str | None] = []
    request = urllib.request.Request(f"{base}/api/models?limit=1", method="HEAD",
                                     headers={"User-Agent": "diloco-hub-probe"})

    def ask() -> None:
        try:
            with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S):  # noqa: S310 - the user's Hub endpoint
                outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)  # it answered: reachable (a missing or private repo is from_pretrained's to say)
        except urllib.error.URLError as exc:
            outcome.append(_describe(exc.reason))
        except OSError as exc:
            outcome.append(_describe(exc))

    thread = threading.Thread(target=ask, name="diloco-hub-probe", daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S + 1.0)
    return outcome[0] if outcome else f"no answer within {PROBE_TIMEOUT_S:g} s"


def _describe(reason: object) -> str:
    if isinstance(reason, TimeoutError):
        return f"no answer within {PROBE_TIMEOUT_S:g} s"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__
