"""Test certificates, made at test time with the openssl CLI: a CA and a node certificate for
127.0.0.1 and localhost that it signed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

HAVE_OPENSSL = shutil.which("openssl") is not None


def make_certificates(directory: Path, name: str = "test") -> dict[str, str]:
    """The TLS variables (COLLECTIVES_TLS_*) naming a fresh CA and a node certificate it signed,
    written under `directory` (created). Each call makes a CA of its own: certificates from two
    calls do not trust each other."""
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60, cwd=directory)

    one_day_rsa = ("-newkey", "rsa:2048", "-nodes", "-days", "1")
    run("req", "-x509", *one_day_rsa, "-keyout", "ca.key", "-out", "ca.pem", "-subj", f"/CN={name}-ca")
    (directory / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=localhost")
    signed_by_ca = ("-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1", "-extfile", "ext.cnf")
    run("x509", "-req", "-in", "node.csr", *signed_by_ca, "-out", "node.pem")
    return {
        "COLLECTIVES_TLS_CERT": str(directory / "node.pem"),
        "COLLECTIVES_TLS_KEY": str(directory / "node.key"),
        "COLLECTIVES_TLS_CA": str(directory / "ca.pem"),
    }
