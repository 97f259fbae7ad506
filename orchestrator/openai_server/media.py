"""Images named by a chat request: ``data:`` URLs always, ``http(s)`` URLs only from hosts
the topology allows (``openai.allowed_media_domains``), with size and time limits."""

from __future__ import annotations

import base64
import binascii
from urllib.parse import urlsplit

import httpx

from orchestrator.protocol import InvalidRequest, TooLarge


class MediaLoader:
    """Turns an ``image_url`` into the image's bytes, never more than ``max_bytes``."""

    def __init__(self, allowed_domains: list[str], timeout_s: float, max_bytes: int) -> None:
        self.allowed = frozenset(d.lower() for d in allowed_domains)
        self.max_bytes = max_bytes
        # No redirects: one could lead to a host that is not allowed.
        self._http = httpx.AsyncClient(timeout=timeout_s, follow_redirects=False)

    async def load(self, url: str, which: str) -> bytes:
        """The bytes behind ``url``; ``InvalidRequest`` or ``TooLarge`` naming ``which``."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            data = self._data_url(url, which)
        elif scheme in ("http", "https"):
            data = await self._fetch(url, which)
        else:
            raise InvalidRequest(f"{which}: the URL must be a data: URL or an http(s) URL")
        if not data:
            raise InvalidRequest(f"{which} is empty")
        return data

    def _data_url(self, url: str, which: str) -> bytes:
        header, sep, payload = url[len("data:") :].partition(",")
        media_type, _, encoding = header.partition(";")
        if not sep or encoding.lower() != "base64":
            raise InvalidRequest(f"{which}: only base64 data URLs are accepted")
        if media_type and not media_type.lower().startswith("image/"):
            raise InvalidRequest(f"{which}: media type {media_type!r} is not an image")
        if len(payload) * 3 // 4 > self.max_bytes:
            raise TooLarge(f"{which} is over the limit of {self.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"{which}: the data URL is not valid base64") from None

    async def _fetch(self, url: str, which: str) -> bytes:
        host = (urlsplit(url).hostname or "").lower()
        if host not in self.allowed:
            allowed = ", ".join(sorted(self.allowed)) or "none"
            raise InvalidRequest(
                f"{which}: images from {host or 'this URL'} are not fetched by this server "
                f"(allowed hosts: {allowed}); send the image as a data: URL"
            )
        data = bytearray()
        try:
            async with self._http.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InvalidRequest(f"{which}: {url} answered HTTP {response.status_code}")
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise TooLarge(f"{which} is over the limit of {self.max_bytes} bytes")
        except httpx.HTTPError as exc:
            raise InvalidRequest(f"{which}: fetching {url} failed: {exc!r}") from None
        return bytes(data)

    async def close(self) -> None:
        await self._http.aclose()
