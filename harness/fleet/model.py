"""What every replica of the fleet shares: the model's render assets, its hash namespace and the
fingerprint a kvgate worker serving it would publish, so that the gateway's parity check and
keys see N copies of one worker."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cachekey.assets import ModelAssets
from cachekey.documents import AssetFiles, FingerprintParts, encode_document
from cachekey.keys import DEFAULT_HASH_SEED, HashNamespace
from cachekey.render import Renderer


@dataclass(frozen=True, slots=True)
class FleetModel:
    name: str  # the served model name (and the namespace's model)
    path: str
    assets: ModelAssets
    renderer: Renderer  # one for all replicas: its segment cache serves them all
    namespace: HashNamespace
    fingerprint: FingerprintParts
    assets_doc: bytes  # /kvgate/assets, encoded once

    @classmethod
    def load(
        cls, model: str, served_name: str, block_size: int = 16, hash_seed: str = DEFAULT_HASH_SEED
    ) -> FleetModel:
        """`model` is a model directory, or "demo" for the project's generated demo model."""
        if model == "demo":
            from worker.demo.model import ensure_demo_model

            path = Path(ensure_demo_model())
        else:
            path = Path(model)
        assets = ModelAssets.from_dir(path)
        ns = HashNamespace(served_name, block_size, hash_seed)
        parts = FingerprintParts(
            **assets.fingerprint_parts(),
            assets=assets.fingerprint(),
            block_size=block_size,
            hash_seed=hash_seed,
            namespace_model=served_name,
        )
        return cls(
            name=served_name,
            path=str(path),
            assets=assets,
            renderer=Renderer(assets),
            namespace=ns,
            fingerprint=parts,
            assets_doc=encode_document(AssetFiles(dict(assets.files))),
        )
