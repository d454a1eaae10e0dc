"""The Kubernetes manifests in k8s/: valid against KubeRay's CRDs, and consistent with deploy/.

The CRD schemas are the ones a KubeRay operator installs (vendored in k8s/crds). jsonschema ignores the
Kubernetes-only keywords (x-kubernetes-*); it is made strict about unknown fields, as `kubectl apply` is by
default, so that a misspelt field fails here rather than being dropped by the API server.
"""

import copy
import json

import jsonschema
import pytest
import yaml

SERVE_FILES = {"rayservice-8b.yaml": "deploy/serve.yaml", "rayservice-70b.yaml": "deploy/serve-70b.yaml",
               "rayservice-70b-fp8.yaml": "deploy/serve-70b-fp8.yaml"}


def _documents(repo):
    docs = []
    for path in sorted((repo / "k8s").glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def _ray_documents(repo):
    return [(name, doc) for name, doc in _documents(repo) if doc["kind"] in ("RayService", "RayCluster")]


def _strict(schema):
    """A copy of `schema` that rejects fields it does not declare (unless it preserves unknown fields)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _errors(schemas, doc):
    validator = jsonschema.Draft7Validator(_strict(schemas[doc["kind"]]))
    return sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))


def _describe(errors):
    return "\n".join(f"  {'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in errors)


def _rayservice(repo, name):
    return yaml.safe_load((repo / "k8s" / name).read_text())


def _pod_specs(cluster_spec):
    yield "head", cluster_spec["headGroupSpec"]
    for group in cluster_spec["workerGroupSpecs"]:
        yield group["groupName"], group


def test_every_manifest_is_a_kubernetes_object(repo):
    docs = _documents(repo)
    assert {name for name, _ in docs} >= {"rayservice-8b.yaml", "rayservice-70b.yaml", "rayservice-70b-fp8.yaml",
                                          "podmonitor.yaml",
                                          "grafana-dashboard-configmap.yaml", "models-pvc.yaml"}
    for name, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), name


def test_ray_manifests_validate_against_kuberay_crds(repo, kuberay_schemas):
    docs = _ray_documents(repo)
    assert len(docs) >= 2
    for name, doc in docs:
        assert doc["apiVersion"] == "ray.io/v1", name
        errors = _errors(kuberay_schemas, doc)
        assert not errors, f"{name} does not match the {doc['kind']} CRD:\n{_describe(errors)}"


def _break_num_gpus(doc):
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0


def _break_group_name(doc):
    del doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]


def _break_max_replicas(doc):
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "8"


def _break_field_name(doc):
    cluster = doc["spec"]["rayClusterConfig"]
    cluster["enableInTreeAutoScaling"] = cluster.pop("enableInTreeAutoscaling")


def _break_serve_config(doc):
    doc["spec"]["serveConfigV2"] = yaml.safe_load(doc["spec"]["serveConfigV2"])


@pytest.mark.parametrize("breaks, where", [
    (_break_num_gpus, "headGroupSpec/rayStartParams/num-gpus"),  # rayStartParams values are strings
    (_break_group_name, "workerGroupSpecs/0"),  # groupName is required
    (_break_max_replicas, "workerGroupSpecs/0/maxReplicas"),  # an integer
    (_break_field_name, "rayClusterConfig"),  # misspelt: an unknown field
    (_break_serve_config, "spec/serveConfigV2"),  # a YAML string, not a mapping
])
def test_schema_check_rejects_a_broken_manifest(repo, kuberay_schemas, breaks, where):
    doc = copy.deepcopy(_rayservice(repo, "rayservice-8b.yaml"))
    breaks(doc)
    errors = _errors(kuberay_schemas, doc)
    assert errors, f"{breaks.__name__} was accepted"
    assert any(where in "/".join(map(str, e.absolute_path)) for e in errors), _describe(errors)


@pytest.mark.parametrize("manifest", sorted(SERVE_FILES))
def test_serve_config_v2_is_the_deploy_file(repo, manifest):
    """One source of truth: the RayService carries deploy/'s Serve config unchanged."""
    embedded = yaml.safe_load(_rayservice(repo, manifest)["spec"]["serveConfigV2"])
    assert embedded == yaml.safe_load((repo / SERVE_FILES[manifest]).read_text()), \
        f"k8s/{manifest} serveConfigV2 differs from {SERVE_FILES[manifest]}: copy the file's content into it"


@pytest.mark.parametrize("manifest", sorted(SERVE_FILES))
def test_rayservice_gpu_layout(repo, manifest):
    """Head without GPUs; each GPU pod holds whole replicas; the autoscaler can reach Serve's maximum."""
    service = _rayservice(repo, manifest)
    cluster = service["spec"]["rayClusterConfig"]
    model = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]["models"][0]
    tp = model["tensor_parallel_size"]
    max_replicas = model.get("autoscaling_config", {}).get("max_replicas", model.get("num_replicas", 1))
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    (group,) = cluster["workerGroupSpecs"]
    container = group["template"]["spec"]["containers"][0]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert int(container["resources"]["requests"]["nvidia.com/gpu"]) == gpus
    assert gpus == tp, "one replica per pod: a replica's GPUs must sit on one node"
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert group["maxReplicas"] * gpus >= max_replicas * tp, "the worker group cannot hold Serve's max_replicas"
    tolerations = group["template"]["spec"]["tolerations"]
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)
    # a host KV tier is pinned host memory the pod must be given: swap_space GiB per GPU, and 16 Gi beside it
    memory_gi = int(container["resources"]["requests"]["memory"].removesuffix("Gi"))
    assert container["resources"]["limits"]["memory"] == container["resources"]["requests"]["memory"]
    assert memory_gi >= model.get("swap_space", 0) * tp + 16, "the pod's memory cannot hold the host KV tier"


@pytest.mark.parametrize("manifest", sorted(SERVE_FILES))
def test_rayservice_pods(repo, manifest):
    """Every Ray pod: Pagoda's image, the metrics port, /dev/shm in memory, the models volume read-only."""
    service = _rayservice(repo, manifest)
    cluster = service["spec"]["rayClusterConfig"]
    model_path = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]["models"][0]["model"]
    for group_name, group in _pod_specs(cluster):
        template = group["template"]
        assert template["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pagoda", group_name
        spec = template["spec"]
        container = spec["containers"][0]
        assert container["image"] == "pagoda:latest"
        assert {"name": "metrics", "containerPort": 8080} in container["ports"], group_name
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
        models = mounts["/models"]
        assert models["readOnly"] is True
        claim = volumes[models["name"]]["persistentVolumeClaim"]
        assert claim == {"claimName": "pagoda-models", "readOnly": True}
        assert model_path.startswith("/models/")


@pytest.mark.parametrize("manifest", sorted(SERVE_FILES))
def test_gpu_workers_are_ready_when_serve_is(repo, manifest):
    cluster = _rayservice(repo, manifest)["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:
        probe = group["template"]["spec"]["containers"][0]["readinessProbe"]
        assert probe["httpGet"] == {"path": "/-/healthz", "port": 8000}


def test_70b_fp8_is_one_gpu_per_replica_in_fp8(repo):
    """The single-GPU 70B: FP8 weights and KV (so it fits one H200), one GPU per pod and per replica."""
    service = _rayservice(repo, "rayservice-70b-fp8.yaml")
    model = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]["models"][0]
    assert (model["quantization"], model["kv_cache_dtype"], model["tensor_parallel_size"]) == ("fp8", "fp8", 1)
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_70b_sets_nccl_site_options(repo):
    (group,) = _rayservice(repo, "rayservice-70b.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    env = {e["name"]: e["value"] for e in group["template"]["spec"]["containers"][0]["env"]}
    assert env["NCCL_NVLS_ENABLE"] == "0"


def test_manifests_use_the_installed_ray(repo):
    import ray

    for manifest in SERVE_FILES:
        assert _rayservice(repo, manifest)["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
    assert f'"ray[serve]=={ray.__version__}"' in (repo / "deploy" / "Dockerfile").read_text()


def test_models_claim_is_read_only_many(repo):
    claim = yaml.safe_load((repo / "k8s" / "models-pvc.yaml").read_text())
    assert claim["kind"] == "PersistentVolumeClaim" and claim["metadata"]["name"] == "pagoda-models"
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_podmonitor_scrapes_the_ray_pods(repo):
    monitor = yaml.safe_load((repo / "k8s" / "podmonitor.yaml").read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/part-of": "pagoda", "ray.io/is-ray-node": "yes"}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_prometheus_config_keeps_the_metrics_port(repo):
    config = yaml.safe_load((repo / "k8s" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "ray"]
    keeps = {(r["source_labels"][0], r["regex"]) for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert keeps == {("__meta_kubernetes_pod_label_ray_io_is_ray_node", "yes"),
                     ("__meta_kubernetes_pod_container_port_name", "metrics")}


def test_dashboard_configmap_is_rendered_from_the_dashboard(repo):
    import importlib.util

    spec = importlib.util.spec_from_file_location("pagoda_k8s_render", repo / "k8s" / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    dashboard_text = (repo / "deploy" / "grafana" / "pagoda.json").read_text()
    committed = (repo / "k8s" / "grafana-dashboard-configmap.yaml").read_text()
    assert committed == render.render_configmap(dashboard_text), "stale ConfigMap: run python k8s/render.py"
    configmap = yaml.safe_load(committed)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["pagoda.json"]) == json.loads(dashboard_text)


def _start_resources(group) -> dict:
    """rayStartParams' resources: a JSON object inside a YAML string, as `ray start --resources` takes it."""
    text = group["rayStartParams"].get("resources")
    return json.loads(yaml.safe_load(text)) if text else {}


@pytest.mark.parametrize("manifest", sorted(SERVE_FILES))
def test_replicas_on_the_gpu_group_ingress_on_the_head(repo, manifest):
    """What the app asks for (replica_resources, ingress_resources) is what the groups declare, so the Ray
    autoscaler grows the GPU group for a pending replica and never puts the ingress on a GPU pod."""
    service = _rayservice(repo, manifest)
    cluster = service["spec"]["rayClusterConfig"]
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    head = _start_resources(cluster["headGroupSpec"])
    (group,) = cluster["workerGroupSpecs"]
    gpu = _start_resources(group)
    for model in args["models"]:
        wanted = model["replica_resources"]
        assert wanted and set(wanted) <= set(gpu) and not set(wanted) & set(head), (wanted, gpu, head)
        assert all(gpu[k] // wanted[k] == 1 for k in wanted), "one replica per pod"
    ingress = args["ingress_resources"]
    assert set(ingress) <= set(head) and not set(ingress) & set(gpu)
    assert all(args["ingress_replicas"] * ingress[k] <= head[k] for k in ingress), "every ingress replica fits"


@pytest.mark.parametrize("manifest", sorted(SERVE_FILES))
def test_head_bounds_the_time_to_notice_a_lost_node(repo, manifest):
    from deploy.serve_env import NODE_HEALTH_ENV

    head = _rayservice(repo, manifest)["spec"]["rayClusterConfig"]["headGroupSpec"]
    env = {e["name"]: e["value"] for e in head["template"]["spec"]["containers"][0]["env"]}
    assert {k: env.get(k) for k in NODE_HEALTH_ENV} == NODE_HEALTH_ENV


def test_schema_check_rejects_resources_as_a_mapping(repo, kuberay_schemas):
    """rayStartParams values are strings: resources written as a YAML mapping would not reach `ray start`."""
    doc = copy.deepcopy(_rayservice(repo, "rayservice-8b.yaml"))
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["resources"] = {"model_slot": 1}
    errors = _errors(kuberay_schemas, doc)
    assert any("rayStartParams/resources" in "/".join(map(str, e.absolute_path)) for e in errors), _describe(errors)


@pytest.mark.parametrize("manifest", sorted(SERVE_FILES))
def test_gpu_pods_share_the_kernel_cache(repo, manifest):
    """TRITON_CACHE_DIR lies on the read-write kernel-cache claim: kernels compiled once serve every replica."""
    claim = yaml.safe_load((repo / "k8s" / "kernel-cache-pvc.yaml").read_text())
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    (group,) = _rayservice(repo, manifest)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    spec = group["template"]["spec"]
    container = spec["containers"][0]
    cache_dir = {e["name"]: e["value"] for e in container["env"]}["TRITON_CACHE_DIR"]
    (mount,) = [m for m in container["volumeMounts"] if cache_dir.startswith(m["mountPath"] + "/")]
    assert not mount.get("readOnly")
    volume = {v["name"]: v for v in spec["volumes"]}[mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
