"""A CA file of one certificate for the suite's Prefect clients (`PREFECT_API_SSL_CERT_FILE`).

Every Prefect client builds a TLS context when it is made, even for a plain-HTTP API,
and by default loads certifi's whole bundle into it: about 25 ms of CPU, and a pod makes
four clients. The suite's Prefect servers all listen on plain HTTP, so its clients never
verify a certificate; with a file of one CA certificate the context costs about half a
millisecond. A user's processes and pods keep Prefect's default.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_END = "-----END CERTIFICATE-----"


def one_certificate_ca_file() -> str:
    """The first certificate of certifi's bundle, in a file of its own (written once)."""
    import certifi

    bundle = Path(certifi.where()).read_text()
    first = bundle[bundle.index("-----BEGIN CERTIFICATE-----") : bundle.index(_END) + len(_END)]
    path = Path(tempfile.gettempdir()) / f"kinetic-prefect-tests-ca-{os.getuid()}.pem"
    if not path.is_file() or path.read_text() != first + "\n":
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(first + "\n")
        os.replace(partial, path)
    return str(path)
