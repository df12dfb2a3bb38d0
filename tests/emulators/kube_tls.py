"""The emulator's serving certificates: a cluster CA generated at start and a server certificate it signs.

Every real API server is HTTPS, and its kubeconfig carries the cluster CA as ``certificate-authority-data`` (what
``aws eks update-kubeconfig`` writes). Serving plain HTTP is not only unlike a cluster, it changes what clients do:
client-go never sends a bearer token over plain HTTP, so ``kubectl`` against an ``http://`` server answers "You must
be logged in to the server" (kubernetes/kubectl#744). So the emulator serves TLS with a fresh CA per start, and
every client (the ``kubernetes`` package, ``kubectl``, ``urllib`` in tests) verifies it; nothing turns
verification off.

The certificates are ECDSA P-256 (instant to generate) with the extensions strict verifiers ask for: the CA is
``CA:TRUE`` with ``keyCertSign``; the leaf names every address it serves as a subjectAltName (Go ignores the
common name), is ``serverAuth`` only, and carries subject and authority key identifiers (OpenSSL 3's strict mode
refuses a leaf without the latter).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServingCertificates:
    """PEM text of the cluster CA, the server certificate and its private key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def server_context(self, folder: Path) -> ssl.SSLContext:
        """A TLS server context for these certificates (``ssl`` loads a chain only from files: under ``folder``)."""
        folder.mkdir(parents=True, exist_ok=True)
        cert, key = folder / "apiserver.crt", folder / "apiserver.key"
        cert.write_bytes(self.cert_pem + self.ca_pem)
        key.write_bytes(self.key_pem)
        key.chmod(0o600)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(cert, key)
        context.set_alpn_protocols(["http/1.1"])  # client-go offers h2 too, and falls back to HTTP/1.1
        return context

    def client_context(self) -> ssl.SSLContext:
        """A verifying client context that trusts only the cluster CA (for raw requests in tests)."""
        return ssl.create_default_context(cadata=self.ca_pem.decode())


def issue(hosts: list[str]) -> ServingCertificates:
    """A new CA and a server certificate for ``hosts`` (IP addresses and DNS names), valid from a minute ago."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now)
          .not_valid_after(now + dt.timedelta(days=3650))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(ca_ski, critical=False)
          .sign(ca_key, hashes.SHA256()))

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*hosts, "127.0.0.1", "::1", "localhost", "kubernetes", "kubernetes.default.svc"]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return ServingCertificates(
        ca_pem=ca.public_bytes(pem), cert_pem=cert.public_bytes(pem),
        key_pem=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


__all__ = ["ServingCertificates", "issue"]
