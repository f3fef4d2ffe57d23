"""Render assets for the gateway: a local `--model-dir`, or the files a worker serves."""

from __future__ import annotations

import asyncio

import httpx

from cachekey.assets import ModelAssets
from cachekey.documents import AssetFiles, decode_document


async def load_assets(model_dir: str | None, worker_urls: list[str], http: httpx.AsyncClient):
    """ModelAssets from `model_dir`, else from the first worker whose /kvgate/assets answers."""
    if model_dir:
        return await asyncio.to_thread(ModelAssets.from_dir, model_dir)
    errors = []
    for url in worker_urls:
        try:
            resp = await http.get(f"{url}/kvgate/assets", timeout=30.0)
            resp.raise_for_status()
            files = decode_document(resp.content, AssetFiles).files
        except (httpx.HTTPError, ValueError) as e:  # DocumentError is a ValueError
            errors.append(f"{url}: {e}")
            continue
        return await asyncio.to_thread(ModelAssets.from_files, files)
    raise RuntimeError("no render assets: " + ("; ".join(errors) or "no worker reachable"))
