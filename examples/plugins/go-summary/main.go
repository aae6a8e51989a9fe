// An example kpng plugin in Go: after each change, one JSON line summing up the node's state
// (services, endpoints, node ports) on stdout or appended to a file, as the Node.js
// state-summary does, but asking for DIFFS in protobuf: the first Apply of a session is the whole
// state, each later one only what changed, so the plugin keeps the state itself.
//
//	go build -o go-summary . && ./go-summary --socket /run/kpng/plugins/summary.sock [--output FILE]
//
// The code under kpng/ is generated from kpng's .proto files (see generate.sh and
// docs/backends/plugins.md); the plugin's own go.mod points at it with a replace directive.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"syscall"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"kpng/api/localv1"
	"kpng/api/pluginv1"
)

// state is the node's state as the Applies built it: services and endpoints by path.
type state struct {
	services  map[string]*localv1.Service
	endpoints map[string]bool
}

func newState() *state {
	return &state{services: map[string]*localv1.Service{}, endpoints: map[string]bool{}}
}

// apply changes the state by one change set; it is checked whole before anything changes.
func (s *state) apply(ops []*localv1.OpItem) error {
	if len(ops) == 0 || ops[len(ops)-1].GetSync() == nil {
		return fmt.Errorf("a change set must end with Sync")
	}
	services := map[string]*localv1.Service{}
	for _, op := range ops {
		if set := op.GetSet(); set != nil && set.Ref.Set == localv1.Set_ServicesSet {
			svc := &localv1.Service{}
			if err := proto.Unmarshal(set.Bytes, svc); err != nil {
				return fmt.Errorf("service %s: %v", set.Ref.Path, err)
			}
			services[set.Ref.Path] = svc
		}
	}
	for _, op := range ops {
		switch {
		case op.GetReset_() != nil:
			*s = *newState()
		case op.GetSet() != nil:
			ref := op.GetSet().Ref
			if ref.Set == localv1.Set_ServicesSet {
				s.services[ref.Path] = services[ref.Path]
			} else if ref.Set == localv1.Set_EndpointsSet {
				s.endpoints[ref.Path] = true
			}
		case op.GetDelete() != nil:
			ref := op.GetDelete()
			if ref.Set == localv1.Set_ServicesSet {
				delete(s.services, ref.Path)
			} else if ref.Set == localv1.Set_EndpointsSet {
				delete(s.endpoints, ref.Path)
			}
		}
	}
	return nil
}

// summary is one output line.
type summary struct {
	Node      string  `json:"node"`
	Revision  uint64  `json:"revision"`
	Services  int     `json:"services"`
	Endpoints int     `json:"endpoints"`
	NodePorts []int32 `json:"nodePorts"`
	Label     *string `json:"label,omitempty"`
}

func (s *state) summarize(node string, revision uint64, label *string) summary {
	ports := []int32{}
	for _, svc := range s.services {
		for _, port := range svc.Ports {
			if port.NodePort != 0 {
				ports = append(ports, port.NodePort)
			}
		}
	}
	sort.Slice(ports, func(i, j int) bool { return ports[i] < ports[j] })
	return summary{node, revision, len(s.services), len(s.endpoints), ports, label}
}

type plugin struct {
	pluginv1.UnimplementedPluginServer
	mu    sync.Mutex
	state *state
	node  string
	label *string
	write func(line []byte) error
}

func (p *plugin) Describe(context.Context, *pluginv1.DescribeRequest) (*pluginv1.DescribeResponse, error) {
	return &pluginv1.DescribeResponse{
		Name: "go-summary", Version: "1.0.0",
		Wants: pluginv1.StateKind_DIFFS, Encoding: pluginv1.Encoding_PROTOBUF,
	}, nil
}

func (p *plugin) Configure(_ context.Context, req *pluginv1.ConfigureRequest) (*pluginv1.ConfigureResponse, error) {
	var label *string
	if config := strings.TrimSpace(string(req.Config)); config != "" {
		var parsed struct {
			Label *string `json:"label"`
		}
		if err := json.Unmarshal([]byte(config), &parsed); err != nil {
			// A non-OK status refuses the configuration; kpng logs the message and retries.
			return nil, status.Errorf(codes.InvalidArgument, "config is not JSON: %v", err)
		}
		label = parsed.Label
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.node, p.label = req.NodeName, label
	log.Printf("go-summary: configured for node %s", req.NodeName)
	return &pluginv1.ConfigureResponse{}, nil
}

func (p *plugin) Apply(_ context.Context, req *pluginv1.ApplyRequest) (*pluginv1.ApplyResponse, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if req.Full != (len(req.Ops) > 0 && req.Ops[0].GetReset_() != nil) {
		return nil, status.Error(codes.InvalidArgument, "Full and a leading Reset disagree")
	}
	if p.state == nil && !req.Full {
		return nil, status.Error(codes.FailedPrecondition, "the first change set must be whole")
	}
	next := newState()
	if p.state != nil {
		*next = *p.state.copy()
	}
	if err := next.apply(req.Ops); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	line, err := json.Marshal(next.summarize(p.node, req.Revision, p.label))
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := p.write(line); err != nil {
		return nil, status.Errorf(codes.Unavailable, "cannot write the summary: %v", err)
	}
	p.state = next
	return &pluginv1.ApplyResponse{}, nil
}

func (s *state) copy() *state {
	c := newState()
	for k, v := range s.services {
		c.services[k] = v
	}
	for k := range s.endpoints {
		c.endpoints[k] = true
	}
	return c
}

func (p *plugin) Health(context.Context, *pluginv1.HealthRequest) (*pluginv1.HealthResponse, error) {
	return &pluginv1.HealthResponse{Ok: true}, nil
}

func main() {
	socket := flag.String("socket", "", "the unix socket to serve the plugin API on (required)")
	output := flag.String("output", "", "append the lines to this file (default: stdout)")
	flag.Parse()
	if *socket == "" {
		log.Fatal("--socket PATH is required")
	}
	write := func(line []byte) error {
		_, err := os.Stdout.Write(append(line, '\n'))
		return err
	}
	if *output != "" {
		write = func(line []byte) error {
			f, err := os.OpenFile(*output, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
			if err != nil {
				return err
			}
			defer f.Close()
			_, err = f.Write(append(line, '\n'))
			return err
		}
	}
	os.Remove(*socket) // a socket left by a crash
	listener, err := net.Listen("unix", *socket)
	if err != nil {
		log.Fatalf("go-summary: cannot listen on %s: %v", *socket, err)
	}
	// A whole state of a large cluster is more than gRPC's default 4 MiB.
	server := grpc.NewServer(grpc.MaxRecvMsgSize(1 << 30))
	pluginv1.RegisterPluginServer(server, &plugin{write: write})
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() { <-stop; server.GracefulStop() }()
	log.Printf("go-summary: listening on unix:%s", *socket)
	if err := server.Serve(listener); err != nil {
		log.Fatal(err)
	}
}
