"""Certificates and keys for the test control plane: a self-signed CA, the API server's
serving certificate (127.0.0.1, localhost, kubernetes.default.svc, the service IP) and the
service-account signing key pair. With the `cryptography` package when it is installed,
else with the openssl command line."""
from __future__ import annotations

import datetime
import os
import shutil
import subprocess
from pathlib import Path


class PKIError(RuntimeError):
    pass


def write_pki(d: Path) -> None:
    """ca.crt, apiserver.crt/.key (for 127.0.0.1 and localhost), sa.key/sa.pub."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        _write_pki_openssl(d)
    else:
        _write_pki_cryptography(d)
    for key in ("ca.key", "apiserver.key", "sa.key"):
        os.chmod(d / key, 0o600)


def _write_pki_cryptography(d: Path) -> None:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def pem_key(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    now = datetime.datetime.now(datetime.timezone.utc)
    not_before, not_after = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=7)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tpufinetune-test-ca")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(srv_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(
            x509.SubjectAlternativeName([
                x509.DNSName("localhost"),
                x509.DNSName("kubernetes.default.svc"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
            ]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    (d / "ca.key").write_bytes(pem_key(ca_key))
    (d / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (d / "apiserver.key").write_bytes(pem_key(srv_key))
    (d / "apiserver.crt").write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    (d / "sa.key").write_bytes(pem_key(sa_key))
    (d / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def _write_pki_openssl(d: Path) -> None:
    if shutil.which("openssl") is None:
        raise PKIError(
            "neither the Python 'cryptography' package nor the openssl CLI is available "
            "to make the test certificates; install one of them"
        )

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "7",
        "-subj", "/CN=tpufinetune-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
        "-addext", "keyUsage=critical,digitalSignature,keyCertSign,cRLSign")
    run("req", "-new", *ec, "-keyout", "apiserver.key", "-out", "apiserver.csr",
        "-subj", "/CN=kube-apiserver")
    (d / "apiserver.ext").write_text(
        "subjectAltName=DNS:localhost,DNS:kubernetes.default.svc,IP:127.0.0.1,IP:10.0.0.1\n"
        "extendedKeyUsage=serverAuth\n"
    )
    run("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "apiserver.crt", "-days", "7", "-extfile", "apiserver.ext")
    run("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key")
    run("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")
