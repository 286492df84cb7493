"""Make sure the tests import the in-tree `flexinfer` package.

flexinfer may be not installed at all, or installed as a non-editable copy that lags
behind the working tree; in both cases the repository root goes first on sys.path.
An editable install already resolves to the tree and is left alone.

There is deliberately no __init__.py in this folder: with one, pytest would import
this folder itself under the name `flexinfer` and shadow the real package.
"""

import importlib.util
import sys
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.find_spec("flexinfer")
if _spec is None or _spec.origin is None or Path(_spec.origin).resolve().parent != _REPO_ROOT / "flexinfer":
    sys.path.insert(0, str(_REPO_ROOT))
