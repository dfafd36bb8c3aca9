"""The keys that hold secrets, and how they stay out of ``run.dir/config.json`` (which multi-node runs keep on
shared storage) and out of error messages.

    buffer.redis_url, prompts.redis_url, rewards.http_url   a password in the URL: written as ``***``
    buffer.curve_secret_key, buffer.curve_client_secret_key  left out of config.json

A resume reads the run's config.json: what it left out comes again from the command line
(``buffer.redis_url=redis://:PASSWORD@host:port/db``) or from the environment (:data:`SECRET_ENV`), read by
``load_config``; a masked password found in neither is refused by ``validate`` with the key and both ways to
give it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

MASK = "***"
"""What config.json holds in place of a password."""
URL_KEYS = ("buffer.redis_url", "prompts.redis_url", "rewards.http_url")
"""Keys whose value is a URL that may carry a password (``scheme://[user]:PASSWORD@host...``, or redis-py's
``?password=``)."""
SECRET_KEYS = ("buffer.curve_secret_key", "buffer.curve_client_secret_key")
"""Keys that are secrets whole (CURVE secret keys): never written."""
SECRET_ENV = {
    "buffer.redis_url": "ASYNC_RLHF_BUFFER_REDIS_PASSWORD",
    "prompts.redis_url": "ASYNC_RLHF_PROMPTS_REDIS_PASSWORD",
    "rewards.http_url": "ASYNC_RLHF_REWARDS_HTTP_PASSWORD",
    "buffer.curve_secret_key": "ASYNC_RLHF_BUFFER_CURVE_SECRET_KEY",
    "buffer.curve_client_secret_key": "ASYNC_RLHF_BUFFER_CURVE_CLIENT_SECRET_KEY",
}
"""Where ``load_config`` finds a secret config.json left out: a URL key's password (filling its ``***``), a
CURVE secret key (filling an empty one)."""
_QUERY_PASSWORD = "password"


def url_password(url: str) -> str | None:
    """The password a URL carries (in its user part or redis-py's ``?password=``), None without one."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # e.g. a port that is not a number: no password we can find
        return None
    if password is not None:
        return password
    return dict(parse_qsl(parts.query)).get(_QUERY_PASSWORD)


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (anything else kept, so the host still shows)."""
    if not url or url_password(url) is None:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}:{MASK}@{hostport}"
    query = parts.query
    if query:
        pairs = [(k, MASK if k == _QUERY_PASSWORD else v) for k, v in parse_qsl(query, keep_blank_values=True)]
        query = urlencode(pairs, safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def is_masked(url: str) -> bool:
    """A URL whose password config.json left out (``***``), to be given again."""
    return url_password(url) == MASK


def with_password(url: str, password: str) -> str:
    """A masked ``url`` with ``password`` in the place of ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:{quote(password, safe='')}@{hostport}"
    query = parts.query
    if query:
        pairs = [(k, password if k == _QUERY_PASSWORD and v == MASK else v)
                 for k, v in parse_qsl(query, keep_blank_values=True)]
        query = urlencode(pairs)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def public_dict(data: dict[str, Any]) -> dict[str, Any]:
    """``Config.to_dict()`` without secrets: URL passwords masked, CURVE secret keys left out (a copy)."""
    out = {section: dict(value) if isinstance(value, dict) else value for section, value in data.items()}
    for key in URL_KEYS:
        section, _, name = key.partition(".")
        if isinstance(out.get(section), dict) and isinstance(out[section].get(name), str):
            out[section][name] = mask_url(out[section][name])
    for key in SECRET_KEYS:
        section, _, name = key.partition(".")
        if isinstance(out.get(section), dict):
            out[section].pop(name, None)
    return out


def fill_secrets(cfg: Any, environ: Mapping[str, str] | None = None) -> None:
    """Give back, from the environment (:data:`SECRET_ENV`), what a config.json left out: a masked URL
    password, an empty CURVE secret key. In place; a value given on the command line stays as given."""
    env = os.environ if environ is None else environ
    for key, var in SECRET_ENV.items():
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        given = env.get(var)
        if not given:
            continue
        if key in URL_KEYS and is_masked(value):
            setattr(getattr(cfg, section), name, with_password(value, given))
        elif key in SECRET_KEYS and not value:
            setattr(getattr(cfg, section), name, given)


def masked_error(key: str) -> str:
    """The error for a URL key still masked after ``load_config``: where its password comes from."""
    return (f"{key} comes from the run's config.json, which never holds its password: give it again on the "
            f"command line ({key}=scheme://:PASSWORD@host:port/...) or in the environment as {SECRET_ENV[key]}")
