"""The files an operator deploys with (deploy/): compose.yaml, the Kubernetes manifests and the
Dockerfiles, checked against the code they start — the settings the service and the runner
read, the CLI commands that exist, the `ray start` flags Ray accepts — and against each other:
names, ports, the shared data path, who holds which secret. No Docker daemon or Kubernetes
cluster is needed; what those would add (building the images, running them) is not checked
here (deploy/README.md says so)."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer.main
import yaml
from ray.scripts.scripts import cli as ray_cli

from runner.settings import RunnerSettings
from service.cli import app as dptune_app
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

API_NEEDS = {
    "DPTUNE_DATABASE_URL",
    "DPTUNE_RAY_ADDRESS",
    "DPTUNE_CONTROL_URL",
    "DPTUNE_DATA_DIR",
    "DPTUNE_OPERATOR_KEY",
    "RAY_AUTH_MODE",
}
RAY_TOKEN = {"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}
SERVICE_SECRETS = {"DPTUNE_DATABASE_URL", "DPTUNE_OPERATOR_KEY"}
RAY_SERVICES = ("ray-head", "ray-worker", "ray-gpu-worker")
DATA_USERS = ("api", *RAY_SERVICES)
DOCKERFILES = sorted(p.name for p in (DEPLOY / "docker").glob("*.Dockerfile"))

Doc = dict[str, Any]


# ---------------------------------------------------------------- reading the files


def compose() -> Doc:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def k8s_docs() -> list[Doc]:
    return [
        doc
        for path in sorted(K8S.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def kustomization() -> Doc:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = (DEPLOY / "docker" / name).read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [
        (parts[0].upper(), parts[1].strip() if len(parts) > 1 else "")
        for line in joined.splitlines()
        if (parts := line.strip().split(None, 1))
    ]


def one(doc_list: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in doc_list if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def compose_env(service: Doc) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: interpolated(str(v)) for k, v in env.items()}


def interpolated(value: str) -> str:
    """A compose value with ``${VAR:-default}`` resolved to its default and a required
    ``${VAR:?message}`` to ``VAR``, as a URL parser can read it."""
    value = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)
    return re.sub(r"\$\{([A-Z0-9_]+)(:\?[^}]*)?\}", r"\1", value)


def container_env(container: Doc) -> dict[str, Doc]:
    return {item["name"]: item for item in container.get("env", [])}


def expand(env: dict[str, Doc], value: str) -> str:
    """Kubernetes' ``$(VAR)`` references, a secret's value shown as ``secret.<name>.<key>``."""

    def value_of(match: re.Match[str]) -> str:
        item = env[match.group(1)]
        if "value" in item:
            return str(item["value"])
        ref = item["valueFrom"]["secretKeyRef"]
        return f"secret.{ref['name']}.{ref['key']}"

    return re.sub(r"\$\(([A-Z0-9_]+)\)", value_of, value)


def pod_specs(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    """(owner, pod spec) of every workload: Deployments, StatefulSets and each group of the
    RayCluster (owner ``RayCluster/<name>/<group>``)."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield f"{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]["spec"]
        elif doc["kind"] == "RayCluster":
            prefix = f"RayCluster/{doc['metadata']['name']}"
            yield f"{prefix}/head", doc["spec"]["headGroupSpec"]["template"]["spec"]
            for group in doc["spec"]["workerGroupSpecs"]:
                yield f"{prefix}/{group['groupName']}", group["template"]["spec"]


def containers(spec: Doc) -> list[Doc]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def ray_groups(cluster: Doc) -> list[Doc]:
    return [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]


def api_container() -> Doc:
    spec = one(k8s_docs(), "Deployment", "dptune-api")["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == "api")


def raycluster() -> Doc:
    return next(d for d in k8s_docs() if d["kind"] == "RayCluster")


def exec_form(instruction: str) -> list[str]:
    argv = json.loads(instruction)
    assert isinstance(argv, list), f"not exec form: {instruction}"
    return argv


# ---------------------------------------------------------------- what the code accepts


def setting_names() -> set[str]:
    fields = {*Settings.model_fields, *RunnerSettings.model_fields}
    return {f"DPTUNE_{name.upper()}" for name in fields}


def options(command: Any) -> set[str]:
    """The option names of a click command (Ray's click, or the copy typer carries)."""
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def check_dptune(argv: list[str]) -> None:
    """``dptune <sub> [<sub>] [--opt …]`` names a command of the typer app with those options."""
    command: Any = typer.main.get_command(dptune_app)
    for word in argv[1:]:
        if word.startswith("-"):
            assert word.split("=")[0] in options(command), f"{argv}: no option {word}"
        elif (subcommands := getattr(command, "commands", None)) is not None:
            assert word in subcommands, f"{argv}: no command {word}"
            command = subcommands[word]
    assert not hasattr(command, "commands"), f"{argv} names a group, not a command"


def check_ray_start(argv: list[str]) -> None:
    assert argv[:2] == ["ray", "start"], f"{argv}: only `ray start` is expected"
    accepted = options(ray_cli.commands["start"])
    for word in argv[2:]:
        assert word.startswith("--") and word.split("=")[0] in accepted, f"ray start: {word}"


def check_command(argv: list[str]) -> None:
    """Every program the files run is one that exists in its image, used as it accepts."""
    program = argv[0]
    if program == "dptune":
        check_dptune(argv)
    elif program == "ray":
        check_ray_start(argv)
    elif program == "python":
        assert argv[1] == "-c", argv
        compile(argv[2], "<health check>", "exec")
    else:
        assert program == "pg_isready", f"unexpected program {argv}"


def flag(argv: list[str], name: str) -> str:
    values = [w.split("=", 1)[1] for w in argv if w.startswith(f"{name}=")]
    assert len(values) == 1, f"{argv}: expected one {name}=…"
    return values[0]


def flag_pair(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# ---------------------------------------------------------------- the checks


def test_every_dptune_variable_is_a_setting() -> None:
    """A misspelt or invented DPTUNE_* variable would be ignored silently (extra="ignore")."""
    files = [*DEPLOY.rglob("*.yaml"), *(DEPLOY / "docker").iterdir(), DEPLOY / "README.md"]
    used = {name for path in files for name in re.findall(r"DPTUNE_[A-Z0-9_]+", path.read_text())}
    assert {"DPTUNE_DATABASE_URL", "DPTUNE_DATA_DIR"} <= used
    assert used <= setting_names(), used - setting_names()


def test_compose_api_gets_what_the_service_needs() -> None:
    services = compose()["services"]
    env = compose_env(services["api"])
    assert env.keys() >= API_NEEDS and env.keys() & RAY_TOKEN
    assert env["RAY_AUTH_MODE"] == "token"
    head = services["ray-head"]["command"]
    ray = urlsplit(env["DPTUNE_RAY_ADDRESS"])
    assert (ray.hostname, str(ray.port)) == ("ray-head", flag(head, "--dashboard-port"))
    control = urlsplit(env["DPTUNE_CONTROL_URL"])
    serve = services["api"]["command"]
    assert control.hostname == "api" and str(control.port) == flag_pair(serve, "--port")
    assert flag_pair(serve, "--host") == "0.0.0.0"
    database = urlsplit(env["DPTUNE_DATABASE_URL"])
    assert database.scheme == "postgresql+psycopg" and database.hostname == "postgres"
    assert database.password == compose_env(services["postgres"])["POSTGRES_PASSWORD"]
    assert compose_env(services["migrate"]) == {"DPTUNE_DATABASE_URL": env["DPTUNE_DATABASE_URL"]}
    assert env["RAY_AUTH_TOKEN"] == compose_env(services["ray-head"])["RAY_AUTH_TOKEN"]


def test_k8s_api_gets_what_the_service_needs() -> None:
    docs = k8s_docs()
    container = api_container()
    env = container_env(container)
    assert env.keys() >= API_NEEDS and env.keys() & RAY_TOKEN
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    cluster = raycluster()
    ray = urlsplit(env["DPTUNE_RAY_ADDRESS"]["value"])
    head = cluster["spec"]["headGroupSpec"]
    head_ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    assert ray.hostname == f"{cluster['metadata']['name']}-head-svc"
    assert (
        ray.port
        == head_ports["dashboard"]
        == int(head["rayStartParams"].get("dashboard-port", 8265))
    )
    control = urlsplit(env["DPTUNE_CONTROL_URL"]["value"])
    service = one(docs, "Service", control.hostname or "")
    port = next(p for p in service["spec"]["ports"] if p["port"] == control.port)
    listens = next(p for p in container["ports"] if p["name"] == port["targetPort"])
    serve = container["command"]
    assert str(listens["containerPort"]) == flag_pair(serve, "--port")
    database_url = expand(env, env["DPTUNE_DATABASE_URL"]["value"])
    database = urlsplit(database_url)
    assert database.scheme == "postgresql+psycopg"
    one(docs, "Service", database.hostname or "")
    assert database.password == "secret.dptune-secrets.postgres-password"
    assert env["DPTUNE_OPERATOR_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "dptune-secrets"
    # the token file the API reads is the Secret the RayCluster's nodes use
    token_path = Path(env["RAY_AUTH_TOKEN_PATH"]["value"])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == token_path.parent)
    spec = one(docs, "Deployment", "dptune-api")["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == cluster["spec"]["authOptions"]["secretName"]
    assert token_path.name == "auth_token"  # the key KubeRay reads from that Secret
    migrate = next(c for c in spec["initContainers"] if c["name"] == "migrate")
    migrate_env = container_env(migrate)
    assert expand(migrate_env, migrate_env["DPTUNE_DATABASE_URL"]["value"]) == database_url


def test_ray_nodes_get_the_ray_token_and_no_service_secret() -> None:
    """Invariant 10: the operator key and database credentials never reach a Ray node; a
    node's processes run trials. Ray nodes authenticate with the cluster token."""
    services = compose()["services"]
    for name in RAY_SERVICES:
        service = services[name]
        env = compose_env(service)
        assert env["RAY_AUTH_MODE"] == "token" and env.keys() & RAY_TOKEN, name
        assert not env.keys() & SERVICE_SECRETS and "env_file" not in service, name
        values = " ".join(env.values())
        assert "POSTGRES_PASSWORD" not in values and "OPERATOR_KEY" not in values, name
    cluster = raycluster()
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": "dptune-ray-token"}
    groups = list(pod_specs([cluster]))
    assert len(groups) == 3
    for owner, spec in groups:
        for container in containers(spec):
            env = container_env(container)
            assert env["RAY_AUTH_MODE"]["value"] == "token", owner
            assert not any(name.startswith("DPTUNE_") for name in env), owner
            assert "envFrom" not in container, owner
        text = json.dumps(spec)
        assert "dptune-secrets" not in text and "POSTGRES" not in text, owner
    for name in ("ray.Dockerfile", "ray-gpu.Dockerfile"):
        envs = " ".join(args for instr, args in dockerfile(name) if instr == "ENV")
        assert "DPTUNE_" not in envs and "RAY_AUTH_MODE=token" in envs, name


def test_commands_are_real_entrypoints() -> None:
    argvs: list[list[str]] = []
    for service in compose()["services"].values():
        if "command" in service:
            argvs.append([interpolated(w) for w in service["command"]])
        if "healthcheck" in service:
            test = service["healthcheck"]["test"]
            assert test[0] == "CMD"
            argvs.append(test[1:])
    for _, spec in pod_specs(k8s_docs()):
        for container in containers(spec):
            if "command" in container:
                argvs.append([*container["command"], *container.get("args", [])])
            for probe in ("readinessProbe", "livenessProbe"):
                if "exec" in container.get(probe, {}):
                    argvs.append(container[probe]["exec"]["command"])
    for group in ray_groups(raycluster()):  # KubeRay runs `ray start --<key>=<value> …`
        params = group["rayStartParams"]
        argvs.append(["ray", "start", *(f"--{k}={v}" for k, v in params.items())])
    for name in DOCKERFILES:
        for instr, args in dockerfile(name):
            if instr in ("CMD", "ENTRYPOINT"):
                argvs.append(exec_form(args))
    assert {argv[0] for argv in argvs} == {"dptune", "ray", "python", "pg_isready"}
    assert ["dptune", "db", "upgrade"] in argvs
    for argv in argvs:
        check_command(argv)


def test_ray_workers_join_the_head() -> None:
    services = compose()["services"]
    head = services["ray-head"]["command"]
    for name in ("ray-worker", "ray-gpu-worker"):
        command = services[name]["command"]
        assert "--block" in command and "--head" not in command
        assert flag(command, "--address") == f"ray-head:{flag(head, '--port')}"
    assert "--block" in head and flag(head, "--dashboard-host") == "0.0.0.0"


def test_the_data_dir_is_one_volume_at_one_path() -> None:
    """The service passes its own absolute DPTUNE_DATA_DIR to every job: datasets are read and
    weights written there on whichever node runs the trial."""
    services = compose()["services"]
    path = compose_env(services["api"])["DPTUNE_DATA_DIR"]
    for name in DATA_USERS:
        mounts = [v.split(":") for v in services[name]["volumes"]]
        assert ["data", path] in mounts, name
    assert "data" in compose()["volumes"]
    api_image_env = " ".join(a for i, a in dockerfile("api.Dockerfile") if i == "ENV")
    assert f"DPTUNE_DATA_DIR={path}" in api_image_env

    docs = k8s_docs()
    k8s_path = container_env(api_container())["DPTUNE_DATA_DIR"]["value"]
    pvc = one(docs, "PersistentVolumeClaim", "dptune-data")
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    owners = [(o, s) for o, s in pod_specs(docs) if "postgres" not in o]
    assert len(owners) == 4  # the API, the head, the CPU and the GPU workers
    for owner, spec in owners:
        volume = next(v for v in spec["volumes"] if "persistentVolumeClaim" in v)
        assert volume["persistentVolumeClaim"]["claimName"] == "dptune-data", owner
        main = spec["containers"][0]
        assert {"name": volume["name"], "mountPath": k8s_path} in main["volumeMounts"], owner


def test_the_services_state_is_never_on_a_ray_nodes_volume() -> None:
    """Invariant 16: the API's state dir (its SQLite database or Ray token file, should it
    keep one) lies outside the data dir and every other volume a Ray node mounts, and no Ray
    node is told where it is."""
    image_env = dict(
        item.split("=", 1)
        for instr, args in dockerfile("api.Dockerfile")
        if instr == "ENV"
        for item in args.split()
    )
    services = compose()["services"]
    k8s_api = {k: v["value"] for k, v in container_env(api_container()).items() if "value" in v}
    ray_mounts = [v.split(":")[1] for name in RAY_SERVICES for v in services[name]["volumes"]]
    ray_envs = [compose_env(services[name]) for name in RAY_SERVICES]
    for group in ray_groups(raycluster()):
        for container in containers(group["template"]["spec"]):
            ray_mounts += [m["mountPath"] for m in container.get("volumeMounts", [])]
            ray_envs.append({k: str(v.get("value")) for k, v in container_env(container).items()})
    for api_env in ({**image_env, **compose_env(services["api"])}, {**image_env, **k8s_api}):
        settings = Settings(
            data_dir=api_env["DPTUNE_DATA_DIR"], state_dir=api_env.get("DPTUNE_STATE_DIR")
        )
        state = settings.state_path
        assert not any(state.is_relative_to(mount) for mount in ray_mounts), state
        assert not any(str(state) in value for env in ray_envs for value in env.values())
        assert settings.data_path.as_posix() in ray_mounts


def test_compose_dependencies_and_health_checks() -> None:
    doc = compose()
    services = doc["services"]
    for name, service in services.items():
        for target, rule in (service.get("depends_on") or {}).items():
            assert target in services, f"{name} depends on unknown {target}"
            if rule["condition"] == "service_healthy":
                assert "healthcheck" in services[target], f"{target} has no health check"
            elif rule["condition"] == "service_completed_successfully":
                assert services[target].get("restart", "no") == "no", target
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in doc["volumes"], f"{name}: {volume}"
    assert services["api"]["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "migrate": {"condition": "service_completed_successfully"},
        "ray-head": {"condition": "service_healthy"},
    }
    postgres = compose_env(services["postgres"])
    test = services["postgres"]["healthcheck"]["test"]
    assert flag_pair(test, "-U") == postgres["POSTGRES_USER"]
    assert flag_pair(test, "-d") == postgres["POSTGRES_DB"]
    database = urlsplit(compose_env(services["api"])["DPTUNE_DATABASE_URL"])
    assert database.username == postgres["POSTGRES_USER"]
    assert database.path == f"/{postgres['POSTGRES_DB']}"


def test_images_are_built_from_this_repository() -> None:
    """Every image compose and Kubernetes name is built by one of the Dockerfiles, at the
    package's version; the Dockerfiles copy every package the project ships."""
    version = PYPROJECT["project"]["version"]
    built: dict[str, str] = {}
    for name, service in compose()["services"].items():
        image = interpolated(service["image"])
        if "build" in service:
            assert service["build"]["context"] == ".."
            dockerfile_path = service["build"]["dockerfile"]
            assert (ROOT / dockerfile_path).is_file(), name
            assert built.setdefault(image, dockerfile_path) == dockerfile_path, image
    assert built == {
        f"dptune-api:{version}": "deploy/docker/api.Dockerfile",
        f"dptune-ray:{version}": "deploy/docker/ray.Dockerfile",
        f"dptune-ray-gpu:{version}": "deploy/docker/ray-gpu.Dockerfile",
    }
    k8s_images = {
        c["image"]
        for _, spec in pod_specs(k8s_docs())
        for c in containers(spec)
        if c["image"].startswith("dptune")
    }
    assert k8s_images == set(built)
    assert {i["name"]: i["newTag"] for i in kustomization()["images"]} == {
        image.split(":")[0]: version for image in built
    }
    packages = {
        p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    for name in DOCKERFILES:
        copied = {
            source
            for instr, args in dockerfile(name)
            if instr == "COPY"
            for source in args.split()[:-1]
        }
        assert copied == {"pyproject.toml", "README.md", *packages}, name


def test_images_share_a_python_and_pin_torch_and_ray() -> None:
    """Ray refuses a node whose Python patch version differs from the head's, and a job's
    entrypoint is the API's own interpreter path, run on the head: one base for all three."""
    dependencies = PYPROJECT["project"]["dependencies"]
    torch = next(d for d in dependencies if d.startswith("torch=="))
    ray_version = next(d for d in dependencies if d.startswith("ray[")).split("==")[1]
    bases = set()
    for name in DOCKERFILES:
        instructions = dockerfile(name)
        args = [a for i, a in instructions if i == "ARG" and a.startswith("PYTHON_IMAGE=")]
        bases.add((*args, *(a for i, a in instructions if i == "FROM")))
        runs = " ".join(a for i, a in instructions if i == "RUN")
        assert f"pip install {torch} " in runs, name
        assert "import torch" in runs, name  # the build checks it got the intended build
    assert bases == {("PYTHON_IMAGE=python:3.11-slim-bookworm", "${PYTHON_IMAGE}")}
    assert raycluster()["spec"]["rayVersion"] == ray_version


def test_gpu_workers_ask_for_gpus() -> None:
    gpu = compose()["services"]["ray-gpu-worker"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert gpu["profiles"] == ["gpu"]
    groups = {g["groupName"]: g for g in raycluster()["spec"]["workerGroupSpecs"]}
    for name, group in groups.items():
        container = group["template"]["spec"]["containers"][0]
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        assert (
            (gpus is not None) == (name == "gpu") == container["image"].startswith("dptune-ray-gpu")
        ), name


def test_k8s_names_and_selectors_agree() -> None:
    docs = k8s_docs()
    templates = {
        f"{d['kind']}/{d['metadata']['name']}": d["spec"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    for owner, spec in templates.items():
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), owner
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        selected = [
            s for s in templates.values() if selector <= s["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, service["metadata"]["name"]
        ports = {
            p["name"] for c in selected[0]["template"]["spec"]["containers"] for p in c["ports"]
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, service["metadata"]["name"]
    statefulset = one(docs, "StatefulSet", "dptune-postgres")
    one(docs, "Service", statefulset["spec"]["serviceName"])
    policy = one(docs, "NetworkPolicy", "dptune-postgres")["spec"]
    postgres_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    api_labels = templates["Deployment/dptune-api"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= postgres_labels.items()
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= api_labels.items()


def test_k8s_secrets_are_generated_from_ignored_files() -> None:
    """Every Secret a manifest refers to comes from kustomization's secretGenerator, with the
    key asked for, made from files under secrets/ that git ignores (so are never committed)."""
    kust = kustomization()
    generated = {
        gen["name"]: {entry.split("=", 1)[0]: entry.split("=", 1)[1] for entry in gen["files"]}
        for gen in kust["secretGenerator"]
    }
    assert kust["generatorOptions"] == {"disableNameSuffixHash": True}
    refs: set[tuple[str, str]] = set()
    for _, spec in pod_specs(k8s_docs()):
        for container in containers(spec):
            for item in container.get("env", []):
                if ref := item.get("valueFrom", {}).get("secretKeyRef"):
                    refs.add((ref["name"], ref["key"]))
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                refs.add((volume["secret"]["secretName"], "*"))
    refs.add((raycluster()["spec"]["authOptions"]["secretName"], "auth_token"))
    for name, key in refs:
        assert name in generated and (key == "*" or key in generated[name]), (name, key)
    files = [K8S / path for entries in generated.values() for path in entries.values()]
    secret_paths = [str(p.relative_to(ROOT)) for p in files] + ["deploy/.env"]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *secret_paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert sorted(ignored) == sorted(secret_paths)
    dockerignore = (ROOT / ".dockerignore").read_text().split()
    assert "deploy" in dockerignore  # no secret in a build context


def test_kustomization_lists_every_manifest() -> None:
    listed = kustomization()["resources"]
    present = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == present
    assert (
        kustomization()["namespace"] == one(k8s_docs(), "Namespace", "dptune")["metadata"]["name"]
    )


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfiles_run_as_an_unprivileged_user(name: str) -> None:
    instructions = dockerfile(name)
    users = [args for instr, args in instructions if instr == "USER"]
    assert users == ["dptune"], name
    last_user = max(i for i, (instr, _) in enumerate(instructions) if instr == "USER")
    assert [i for i, _ in instructions[last_user:]].count("RUN") == 0, name


def test_pods_run_as_the_images_user() -> None:
    """The shared volume is written by the API and by every Ray node: one uid, and fsGroup so
    that a fresh volume is writable by it."""
    uids = {
        re.search(r"--uid (\d+)", args).group(1)  # type: ignore[union-attr]
        for name in DOCKERFILES
        for instr, args in dockerfile(name)
        if instr == "RUN" and "useradd" in args
    }
    assert len(uids) == 1
    uid = int(uids.pop())
    for owner, spec in pod_specs(k8s_docs()):
        if "postgres" in owner:
            continue
        context = spec["securityContext"]
        assert context["runAsUser"] == context["fsGroup"] == uid, owner
        assert context["runAsNonRoot"] is True, owner
