"""Certificates and the service-account key pair for a local control plane (openssl CLI)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FRONT_PROXY_CN", "Pki", "make_pki", "make_serving_cert"]

# The only client the apiserver trusts to assert a user in request headers (the
# aggregation layer's proxy identity).
FRONT_PROXY_CN = "front-proxy-client"

_DAYS = "3650"


@dataclass(frozen=True)
class Pki:
    """File layout of `<state>/pki`: one CA signs the apiserver's serving cert and the
    admin client cert (group `system:masters`, which RBAC lets do everything)."""

    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def apiserver_crt(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def apiserver_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def admin_crt(self) -> Path:
        return self.dir / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.dir / "admin.key"

    @property
    def front_proxy_crt(self) -> Path:
        return self.dir / "front-proxy-client.crt"

    @property
    def front_proxy_key(self) -> Path:
        return self.dir / "front-proxy-client.key"

    @property
    def kubelet_client_crt(self) -> Path:
        """The apiserver's client cert towards kubelets (`kubectl logs/exec` on a real node)."""
        return self.dir / "apiserver-kubelet-client.crt"

    @property
    def kubelet_client_key(self) -> Path:
        return self.dir / "apiserver-kubelet-client.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def make_pki(directory: Path, service_ip: str) -> Pki:
    """Create the CA, certs and service-account keys under `directory`.

    `service_ip` (first address of the service range) goes into the serving
    cert's SANs with the in-cluster DNS names, as kubeadm does.
    """
    if shutil.which("openssl") is None:
        raise RuntimeError("making certificates needs the openssl command (apt install openssl)")
    directory.mkdir(parents=True, exist_ok=True)
    ssl = _OpenSSL(directory)
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", _DAYS, "-subj", "/CN=kvflow-local-ca")  # fmt: skip
    sans = ",".join([*(f"DNS:{n}" for n in _APISERVER_DNS), "IP:127.0.0.1", f"IP:{service_ip}"])
    ssl.signed("apiserver", "/CN=kube-apiserver", f"subjectAltName={sans}", "serverAuth")
    ssl.signed("admin", "/O=system:masters/CN=kvflow-admin", None, "clientAuth")
    ssl.signed("front-proxy-client", f"/CN={FRONT_PROXY_CN}", None, "clientAuth")
    # kubeadm's name and group for the apiserver's identity towards kubelets.
    ssl.signed(
        "apiserver-kubelet-client",
        "/O=kubeadm:cluster-admins/CN=kube-apiserver-kubelet-client",
        None,
        "clientAuth",
    )
    ssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key")
    ssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")
    for key in directory.glob("*.key"):
        key.chmod(0o600)
    return Pki(directory)


def make_serving_cert(pki: Pki, name: str, directory: Path) -> Path:
    """A serving cert for a webhook on loopback (SAN IP 127.0.0.1), signed by `pki`'s CA,
    as `directory/tls.crt` and `tls.key` (controller-runtime's names); returns `directory`."""
    ssl = _OpenSSL(pki.dir)
    ssl.signed(name, f"/CN={name}", "subjectAltName=IP:127.0.0.1", "serverAuth")
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(pki.dir / f"{name}.crt", directory / "tls.crt")
    shutil.copyfile(pki.dir / f"{name}.key", directory / "tls.key")
    (directory / "tls.key").chmod(0o600)
    return directory


_APISERVER_DNS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


class _OpenSSL:
    """`openssl` run inside the PKI directory."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory

    def __call__(self, *args: str) -> None:
        subprocess.run(["openssl", *args], cwd=self._dir, check=True, capture_output=True)

    def signed(self, name: str, subject: str, san: str | None, usage: str) -> None:
        """A key and a CA-signed cert `<name>.{key,crt}` for `usage` (serverAuth|clientAuth)."""
        ext = [f"extendedKeyUsage={usage}", "keyUsage=critical,digitalSignature,keyEncipherment"]
        (self._dir / f"{name}.ext").write_text("\n".join([*([san] if san else []), *ext]) + "\n")
        self("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", subject)  # fmt: skip
        self("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-set_serial", str(secrets.randbits(63)), "-days", _DAYS,
             "-extfile", f"{name}.ext", "-out", f"{name}.crt")  # fmt: skip
