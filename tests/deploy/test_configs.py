"""The deployment files hold what an operator relies on, checked with the tools that read them.

* The ``ray up`` files go through Ray's own autoscaler code (``prepare_config``,
  ``validate_config`` against ``ray-schema.json``, the ``ray start`` CLI parser, the
  ``docker run`` command builder) as far as it runs without a cloud account.
* The KubeRay manifests parse and name the resources, ports and limits they must.
* The image recipe pins every package and runs as a non-root user.
* Every ``kvserve ...`` command line in deploy/README.md and in the YAML files
  parses with kvserve's own CLI parser, and so do the ``kvserve serve`` options
  given to ``kvserve-frontend start``, the background service of the head node.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import pytest
import ray
import yaml
from packaging.requirements import Requirement
from ray.autoscaler._private.docker import docker_start_cmds
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.autoscaler.sdk import get_docker_host_mount_location

from tests.deploy.shell_commands import (
    SimpleCommand,
    markdown_code_spans,
    markdown_shell_scripts,
    simple_commands,
)
from tests.toml_reader import tomllib

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RAY_UP_FILES = ("aws-gpu.yaml", "gcp-gpu.yaml")
KUBERAY_FILES = ("kuberay/raycluster-gpu.yaml", "kuberay/raycluster-cpu.yaml")
IMAGE = "ghcr.io/kvserve/kvserve:0.1.0"
TOKEN_PATH = "/home/ray/ray-auth/auth_token"
RAY_PORTS = {6379, 8265, 10001}
GRPC_PORT = 50051
HTTP_PORT = 8000
COMMAND_LISTS = (
    "initialization_commands",
    "setup_commands",
    "head_setup_commands",
    "worker_setup_commands",
    "head_start_ray_commands",
    "worker_start_ray_commands",
)


# --- loaders ---------------------------------------------------------------------------


def ray_up(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def prepared(name: str) -> dict:
    """The config as ``ray up`` has it after Ray's own offline preparation."""
    return prepare_config(copy.deepcopy(ray_up(name)))


def kuberay(name: str) -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / name).read_text()))


def raycluster(name: str) -> dict:
    (cluster,) = [d for d in kuberay(name) if d["kind"] == "RayCluster"]
    return cluster


def containers(cluster: dict) -> list[dict]:
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"].get("workerGroupSpecs", [])]
    return [c for group in groups for c in group["template"]["spec"]["containers"]]


def head_container(cluster: dict) -> dict:
    return cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def requirement_pins() -> dict[str, Requirement]:
    lines = (DEPLOY / "requirements-cuda.txt").read_text().splitlines()
    requirements = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {r.name.lower().replace("_", "-"): r for r in requirements}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


# --- kvserve command lines in the guide and the cluster files ---------------------------


def kvserve_argvs(script: str) -> list[tuple[str, ...]]:
    """The ``kvserve`` command lines of a script, with ``kvserve-frontend start OPTIONS``
    read as the ``kvserve serve OPTIONS`` it runs."""
    argvs = []
    for command in simple_commands(script):
        program, args = Path(command.argv[0]).name, command.argv[1:]
        if program == "kvserve":
            argvs.append(("kvserve", *args))
        elif program == "kvserve-frontend" and args[:1] == ("start",):
            argvs.append(("kvserve", "serve", *args[1:]))
    return argvs


def readme_scripts() -> list[str]:
    """The guide's shell code blocks, and its inline code spans that are whole
    command lines (``kvserve SUBCOMMAND`` followed by arguments)."""
    text = (DEPLOY / "README.md").read_text()
    spans = [s for s in markdown_code_spans(text) if s.startswith("kvserve ") and len(shlex.split(s)) > 2]
    return markdown_shell_scripts(text) + spans


def yaml_scripts(name: str) -> list[str]:
    """The shell scripts a YAML file runs, and the example commands in its comments
    (comment lines indented by two or more spaces after the ``#``)."""
    text = (DEPLOY / name).read_text()
    scripts = re.findall(r"^\s*#(?: {2,}|\t)(.*)$", text, flags=re.M)
    for document in yaml.safe_load_all(text):
        if document.get("kind") == "RayCluster":
            scripts += ["\n".join(c.get("args", [])) for c in containers(document)]
        elif "provider" in document:
            scripts += [cmd for key in COMMAND_LISTS for cmd in document.get(key, [])]
    return scripts


def _command_lines() -> list[tuple[str, tuple[str, ...]]]:
    sources = {"README.md": readme_scripts()}
    sources |= {name: yaml_scripts(name) for name in RAY_UP_FILES + KUBERAY_FILES}
    return [(name, argv) for name, scripts in sources.items() for s in scripts for argv in kvserve_argvs(s)]


COMMAND_LINES = _command_lines()


# --- ray up ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", RAY_UP_FILES)
def test_ray_up_config_passes_rays_own_validation(name: str) -> None:
    # validate_config checks ray-schema.json, head_node_type and the sum of min_workers.
    validate_config(prepared(name))


@pytest.mark.parametrize("name", RAY_UP_FILES)
def test_ray_up_replaces_rays_default_setup_commands(name: str) -> None:
    """Ray's defaults pip-install Ray and cloud SDKs on every boot; the image has them."""
    raw, config = ray_up(name), prepared(name)
    assert config["head_setup_commands"] == raw["setup_commands"] + raw["head_setup_commands"]
    assert config["worker_setup_commands"] == raw["setup_commands"] + raw["worker_setup_commands"]
    every_command = " ".join(cmd for key in COMMAND_LISTS for cmd in config[key])
    assert "pip install" not in every_command
    assert "$RAY_AUTH_TOKEN_PATH" in config["setup_commands"][0]  # the token check comes first


@pytest.mark.parametrize("name", RAY_UP_FILES)
def test_ray_up_has_a_cpu_head_and_autoscaling_1x_and_8x_gpu_types(name: str) -> None:
    config = prepared(name)
    node_types = config["available_node_types"]
    head = node_types.pop(config["head_node_type"])
    assert head["resources"].get("GPU", 0) == 0
    assert head["max_workers"] == 0  # filled in by prepare_config
    assert sorted(t["resources"]["GPU"] for t in node_types.values()) == [1, 8]
    for node_type in node_types.values():
        assert node_type["min_workers"] == 0 < node_type["max_workers"] <= config["max_workers"]
    assert "--gpus all" in config["docker"]["worker_run_options"]
    assert "--gpus all" not in config["docker"].get("head_run_options", [])


def _ray_starts(commands: list[str]) -> list[tuple[SimpleCommand, dict]]:
    from ray.scripts.scripts import start

    found = [c for cmd in commands for c in simple_commands(cmd) if c.argv[:2] == ("ray", "start")]
    return [(c, start.make_context("start", list(c.argv[2:])).params) for c in found]


@pytest.mark.parametrize("name", RAY_UP_FILES)
def test_head_starts_ray_with_token_auth_and_a_localhost_dashboard(name: str) -> None:
    ((command, params),) = _ray_starts(prepared(name)["head_start_ray_commands"])
    assert command.env == {"RAY_AUTH_MODE": "token"}
    assert params["head"] is True
    assert (params["port"], params["dashboard_port"], params["ray_client_server_port"]) == (6379, 8265, 10001)
    assert params["dashboard_host"] == "127.0.0.1"
    assert params["autoscaling_config"] == "~/ray_bootstrap_config.yaml"


@pytest.mark.parametrize("name", RAY_UP_FILES)
def test_workers_join_the_head_with_token_auth(name: str) -> None:
    ((command, params),) = _ray_starts(prepared(name)["worker_start_ray_commands"])
    assert command.env == {"RAY_AUTH_MODE": "token"}
    assert params["address"] == "$RAY_HEAD_IP:6379"


@pytest.mark.parametrize("name", RAY_UP_FILES)
def test_containers_get_token_auth_and_the_token_file(name: str) -> None:
    """The `docker run` that Ray itself builds from the config sets the token variables
    and bind-mounts the synced token directory where RAY_AUTH_TOKEN_PATH points."""
    config = prepared(name)
    docker = config["docker"]
    token_dir = str(Path(TOKEN_PATH).parent)
    assert config["file_mounts"][token_dir] == "~/.kvserve/ray-auth"
    run = docker_start_cmds(
        "ubuntu", docker["image"], config["file_mounts"], docker["container_name"],
        docker["run_options"], config["cluster_name"], "/home/ray", "docker",
    )
    assert "--env RAY_AUTH_MODE=token" in run
    assert f"--env RAY_AUTH_TOKEN_PATH={TOKEN_PATH}" in run
    host_copy = f"{get_docker_host_mount_location(config['cluster_name'])}/{token_dir}"
    assert f"-v {host_copy}:{token_dir} " in run
    assert "--net=host" in run


@pytest.mark.parametrize("name", RAY_UP_FILES)
def test_cloud_bootstrap_needs_credentials(name: str) -> None:
    provider = ray_up(name)["provider"]["type"]
    pytest.skip(
        f"`ray up` goes on with the {provider} node provider's fillout_available_node_types_resources "
        "and bootstrap_config, which call the cloud's APIs (instance types, IAM role or service "
        "account, key pair, subnets, security group): they need a cloud account and credentials"
    )


# --- KubeRay ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", KUBERAY_FILES)
def test_kuberay_manifest_is_a_raycluster_with_token_auth(name: str) -> None:
    cluster = raycluster(name)
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert cluster["spec"]["rayVersion"] == ray.__version__
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": "kvserve-ray-auth"}
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"


@pytest.mark.parametrize("name", KUBERAY_FILES)
def test_head_declares_the_ray_ports_and_the_front_ends_grpc_and_http_ports(name: str) -> None:
    ports = {p["containerPort"] for p in head_container(raycluster(name))["ports"]}
    assert ports == RAY_PORTS | {GRPC_PORT, HTTP_PORT}


@pytest.mark.parametrize("name", KUBERAY_FILES)
def test_nothing_is_exposed_outside_the_kubernetes_cluster(name: str) -> None:
    head_group = raycluster(name)["spec"]["headGroupSpec"]
    assert head_group.get("serviceType", "ClusterIP") == "ClusterIP"
    assert not head_group.get("enableIngress", False)
    for service in (d for d in kuberay(name) if d["kind"] == "Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert {d["kind"] for d in kuberay(name)} == {"RayCluster", "Service"}


@pytest.mark.parametrize("name", KUBERAY_FILES)
def test_a_service_routes_grpc_and_http_to_the_head(name: str) -> None:
    # HTTP (the OpenAI API and /metrics) was served on the head but reachable from nowhere.
    cluster = raycluster(name)
    (service,) = [d for d in kuberay(name) if d["kind"] == "Service"]
    assert service["apiVersion"] == "v1"
    head_pods = {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    assert service["spec"]["selector"] == head_pods
    named = {p["name"]: p["containerPort"] for p in head_container(cluster)["ports"]}
    routed = {port["port"]: named[port["targetPort"]] for port in service["spec"]["ports"]}
    assert routed == {GRPC_PORT: GRPC_PORT, HTTP_PORT: HTTP_PORT}


@pytest.mark.parametrize("name", KUBERAY_FILES)
def test_pods_run_the_image_as_non_root(name: str) -> None:
    cluster = raycluster(name)
    assert {c["image"] for c in containers(cluster)} == {IMAGE}
    groups = [cluster["spec"]["headGroupSpec"]] + cluster["spec"]["workerGroupSpecs"]
    assert all(g["template"]["spec"]["securityContext"]["runAsNonRoot"] is True for g in groups)


def test_gpu_worker_groups_have_gpu_limits() -> None:
    cluster = raycluster("kuberay/raycluster-gpu.yaml")
    gpus = []
    for group in cluster["spec"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        gpus.append(container["resources"]["limits"]["nvidia.com/gpu"])
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert sorted(gpus) == [1, 8]
    assert "nvidia.com/gpu" not in head_container(cluster)["resources"]["limits"]
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"


def _quantity(value: str | int) -> float:
    units = {"m": 1e-3, "Mi": 2**20, "Gi": 2**30}
    match = re.fullmatch(r"([0-9.]+)(m|Mi|Gi)?", str(value))
    return float(match[1]) * units.get(match[2] or "", 1)


def test_cpu_workers_offer_the_rank_slots_kvserve_places_cpu_ranks_on() -> None:
    from kvserve.cluster.worker_actor import WORKER_CPU_RESOURCE

    (group,) = raycluster("kuberay/raycluster-cpu.yaml")["spec"]["workerGroupSpecs"]
    # KubeRay passes the value to `ray start --resources=...` as a quoted JSON string.
    resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
    assert resources[WORKER_CPU_RESOURCE] >= 1


def test_cpu_variant_has_no_gpus_and_small_pods() -> None:
    assert "nvidia.com/gpu" not in (DEPLOY / "kuberay/raycluster-cpu.yaml").read_text()
    for container in containers(raycluster("kuberay/raycluster-cpu.yaml")):
        limits = container["resources"]["limits"]
        assert _quantity(limits["cpu"]) <= 2 and _quantity(limits["memory"]) <= 4 * 2**30


# --- image -----------------------------------------------------------------------------


def test_every_image_requirement_is_pinned_exactly() -> None:
    for requirement in requirement_pins().values():
        (specifier,) = requirement.specifier
        assert specifier.operator == "==" and "*" not in specifier.version, str(requirement)


def test_image_pins_satisfy_kvserve_and_match_the_tested_ray() -> None:
    pins = requirement_pins()
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dependency in map(Requirement, dependencies):
        pin = pins[dependency.name.lower()]
        (pinned,) = pin.specifier
        assert dependency.specifier.contains(pinned.version), f"{pin} does not satisfy {dependency}"
        assert dependency.extras <= pin.extras
    (ray_pin,) = pins["ray"].specifier
    assert ray_pin.version == ray.__version__


def test_torch_is_the_cuda_build_of_the_base_images_cuda() -> None:
    (base,) = [arg for op, arg in dockerfile_instructions() if op == "FROM"]
    cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-\w+-ubuntu[\d.]+", base)
    pins = requirement_pins()
    assert cuda is not None, base
    assert "torch" in pins
    (runtime,) = pins["nvidia-cuda-runtime"].specifier
    assert runtime.version.split(".")[0] == cuda[1]
    assert f"nvidia-nccl-cu{cuda[1]}" in pins


def test_image_installs_the_pins_and_kvserve_from_the_repository() -> None:
    runs = [arg for op, arg in dockerfile_instructions() if op == "RUN"]
    copies = [arg.split() for op, arg in dockerfile_instructions() if op == "COPY"]
    installs_pins = "pip install --no-deps -r /tmp/requirements-cuda.txt"
    assert any(installs_pins in run and "pip check" in run for run in runs)
    assert ["deploy/requirements-cuda.txt", "/tmp/requirements-cuda.txt"] in copies
    assert any(copy[0] == "pyproject.toml" for copy in copies)
    assert any(re.search(r"pip install --no-deps \S* ?/src/kvserve\b", run) for run in runs)


def test_image_installs_the_front_end_service() -> None:
    copies = [arg.split() for op, arg in dockerfile_instructions() if op == "COPY"]
    assert ["--chmod=0755", "deploy/kvserve-frontend", "/usr/local/bin/kvserve-frontend"] in copies


def test_image_runs_as_non_root_with_token_auth_and_exposes_grpc() -> None:
    instructions = dockerfile_instructions()
    users = [arg for op, arg in instructions if op == "USER"]
    env = " ".join(arg for op, arg in instructions if op == "ENV")
    assert users and users[-1] not in {"root", "0"}
    exposed = [port for op, arg in instructions if op == "EXPOSE" for port in arg.split()]
    assert str(GRPC_PORT) in exposed and str(HTTP_PORT) in exposed
    assert "RAY_AUTH_MODE=token" in env.split()
    # `ray up` reads HOME from the image to place `~/` paths in the container.
    assert "HOME=/home/ray" in env.split() and TOKEN_PATH.startswith("/home/ray/")


def test_build_context_lets_in_what_the_dockerfile_copies() -> None:
    ignore_file = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:] for line in ignore_file if line.startswith("!")}
    for op, arg in dockerfile_instructions():
        if op == "COPY":
            sources = [word for word in arg.split()[:-1] if not word.startswith("--")]
            assert set(sources) <= allowed, arg


# --- kvserve command lines: tests -------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "argv"), COMMAND_LINES, ids=[f"{source}: {shlex.join(argv)}" for source, argv in COMMAND_LINES]
)
def test_kvserve_command_line_parses(source: str, argv: tuple[str, ...]) -> None:
    from kvserve.cli import build_parser

    try:
        build_parser().parse_args(list(argv[1:]))
    except SystemExit as exc:
        asked_for_help = {"-h", "--help"} & set(argv)
        assert asked_for_help and exc.code == 0, f"{source}: `{shlex.join(argv)}` does not parse"


def test_the_guides_gpu_front_ends_run_on_cuda() -> None:
    # The front ends that join a GPU cluster (--address, a model under /models), as the cluster files.
    serves = [
        argv for source, argv in COMMAND_LINES
        if source == "README.md" and argv[1] == "serve" and "--address" in argv and "/models/" in " ".join(argv)
    ]
    assert len(serves) >= 4
    assert all("--device" in argv and argv[argv.index("--device") + 1] == "cuda" for argv in serves)


def test_guide_shows_every_subcommand_it_relies_on() -> None:
    subcommands = {argv[1] for source, argv in COMMAND_LINES if source == "README.md"}
    assert {"serve", "generate", "create-tiny-model"} <= subcommands


@pytest.mark.parametrize("name", RAY_UP_FILES + KUBERAY_FILES)
def test_each_cluster_file_starts_one_front_end_on_the_grpc_port(name: str) -> None:
    (serve,) = [argv for script in yaml_scripts(name) for argv in kvserve_argvs(script) if argv[1] == "serve"]
    flags = dict(zip(serve[2::2], serve[3::2]))
    assert flags["--address"] == "auto"
    assert (flags["--host"], flags["--port"]) == ("0.0.0.0", str(GRPC_PORT))
    if name.endswith("cpu.yaml"):
        assert "--model" not in flags  # the embedded tiny model
        return
    # GPU nodes start on demand: without --device cuda kvserve saw no GPU in the
    # cluster, its replicas asked for CPU slots, and no GPU node was ever added.
    assert flags["--device"] == "cuda"
    if name in RAY_UP_FILES:
        assert any(flags["--model"].startswith(remote) for remote in ray_up(name)["file_mounts"])
    else:
        mounts = {m["mountPath"] for m in head_container(raycluster(name))["volumeMounts"]}
        assert any(flags["--model"].startswith(mount + "/") for mount in mounts)



def test_the_image_can_build_the_cuda_kernels_just_in_time() -> None:
    (base,) = [arg for op, arg in dockerfile_instructions() if op == "FROM"]
    assert "-devel-" in base, "kernels/csrc is compiled with nvcc on the GPU nodes"
    assert "ninja" in requirement_pins()


@pytest.mark.parametrize("name", RAY_UP_FILES + KUBERAY_FILES)
def test_each_front_end_needs_bearer_tokens_and_speaks_tls_from_mounted_files(name: str) -> None:
    (serve,) = [argv for script in yaml_scripts(name) for argv in kvserve_argvs(script) if argv[1] == "serve"]
    flags = dict(zip(serve[2::2], serve[3::2]))
    paths = [flags["--auth-token-file"], flags["--tls-cert"], flags["--tls-key"]]
    if name in RAY_UP_FILES:
        mounted = list(ray_up(name)["file_mounts"])
    else:
        mounted = [m["mountPath"] for m in head_container(raycluster(name))["volumeMounts"]]
    assert all(any(path.startswith(mount + "/") for mount in mounted) for path in paths), (paths, mounted)
