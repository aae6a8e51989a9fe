"""Print a node's state from a kpng server: print_state.py --api URL --node-name NAME [--once]"""

from kpng.client import IPSet, NodeState, PortMapping, run


def ips(*sets: IPSet | None) -> str:
    return " ".join(ip for s in sets if s is not None for ip in (*s.V4, *s.V6)) or "-"


def port(p: PortMapping) -> str:
    return f"{p.Port}/{p.Protocol}" + (f" (node port {p.NodePort})" if p.NodePort else "")


def show(state: NodeState) -> None:
    print(f"{state.node}, revision {state.revision}: {len(state.services)} services")
    for (namespace, name), entry in sorted(state.services.items()):
        svc, i = entry.service, entry.service.IPs
        vips = ips(i.ClusterIPs, i.ExternalIPs, i.LoadBalancerIPs) if i is not None else "-"
        head = f"{namespace}/{name} ({svc.Type}) {vips} ports {', '.join(map(port, svc.Ports))}"
        print(f"{head}, endpoints: {len(entry.endpoints)}")
        for ep in entry.endpoints:
            scopes = [s for s in ("Internal", "External", "Cluster") if getattr(ep.Scopes, s, 0)]
            targets = ", ".join(f"{p.Name or p.Protocol}→{p.Port}" for p in ep.PortOverrides)
            print(f"    {ips(ep.IPs)}  {' '.join(scopes)}  {targets}" + "  local" * ep.Local)
    print(flush=True)


if __name__ == "__main__":
    run(show, description="Print a node's state from a kpng server, after every change.")
