//go:build integration

package cri

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// callTimeout bounds every CRI call. RunPodSandbox runs the whole CNI
// chain (and waits for containerd's per-sandbox work), so it is generous.
const callTimeout = 90 * time.Second

// criClient is the part of the CRI v1 RuntimeService the suite uses, as
// kubelet uses it for pods: run, inspect, stop and remove sandboxes. Safe
// for concurrent use (gRPC is).
type criClient struct {
	conn *grpc.ClientConn
	rt   runtimeapi.RuntimeServiceClient
}

func dialCRI(sock string) (*criClient, error) {
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("CRI client for %s: %w", sock, err)
	}
	return &criClient{conn: conn, rt: runtimeapi.NewRuntimeServiceClient(conn)}, nil
}

func (c *criClient) Close() error { return c.conn.Close() }

func call[T any](fn func(ctx context.Context) (T, error)) (T, error) {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	return fn(ctx)
}

// version is the runtime's name and version ("containerd 1.6.20~ds1").
func (c *criClient) version() (string, error) {
	r, err := call(func(ctx context.Context) (*runtimeapi.VersionResponse, error) {
		return c.rt.Version(ctx, &runtimeapi.VersionRequest{})
	})
	if err != nil {
		return "", err
	}
	return r.RuntimeName + " " + r.RuntimeVersion, nil
}

// networkReady reports the runtime's NetworkReady condition (false until
// containerd has loaded a CNI configuration) and its message.
func (c *criClient) networkReady() (bool, string, error) {
	r, err := call(func(ctx context.Context) (*runtimeapi.StatusResponse, error) {
		return c.rt.Status(ctx, &runtimeapi.StatusRequest{})
	})
	if err != nil {
		return false, "", err
	}
	for _, cond := range r.GetStatus().GetConditions() {
		if cond.Type == runtimeapi.NetworkReady {
			return cond.Status, cond.Reason + ": " + cond.Message, nil
		}
	}
	return false, "no NetworkReady condition", nil
}

// runPod starts a sandbox and returns its ID.
func (c *criClient) runPod(cfg *runtimeapi.PodSandboxConfig) (string, error) {
	r, err := call(func(ctx context.Context) (*runtimeapi.RunPodSandboxResponse, error) {
		return c.rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: cfg})
	})
	if err != nil {
		return "", err
	}
	return r.PodSandboxId, nil
}

func (c *criClient) stopPod(id string) error {
	_, err := call(func(ctx context.Context) (*runtimeapi.StopPodSandboxResponse, error) {
		return c.rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: id})
	})
	return err
}

func (c *criClient) removePod(id string) error {
	_, err := call(func(ctx context.Context) (*runtimeapi.RemovePodSandboxResponse, error) {
		return c.rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: id})
	})
	return err
}

// podStatus is what the suite reads of a sandbox's status.
type podStatus struct {
	State runtimeapi.PodSandboxState
	IP    string // the pod IP containerd took from the CNI result
	Pid   int    // the sandbox process (its network namespace is the pod's)
}

func (c *criClient) status(id string) (podStatus, error) {
	r, err := call(func(ctx context.Context) (*runtimeapi.PodSandboxStatusResponse, error) {
		return c.rt.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id, Verbose: true})
	})
	if err != nil {
		return podStatus{}, err
	}
	st := podStatus{State: r.GetStatus().GetState(), IP: r.GetStatus().GetNetwork().GetIp()}
	// Verbose status carries containerd's own view as JSON under "info".
	var info struct {
		Pid int `json:"pid"`
	}
	if raw := r.GetInfo()["info"]; raw != "" {
		if err := json.Unmarshal([]byte(raw), &info); err != nil {
			return st, fmt.Errorf("sandbox %s: verbose info: %w", id, err)
		}
	}
	st.Pid = info.Pid
	return st, nil
}

// pods lists the IDs of every sandbox the runtime knows.
func (c *criClient) pods() ([]string, error) {
	r, err := call(func(ctx context.Context) (*runtimeapi.ListPodSandboxResponse, error) {
		return c.rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	})
	if err != nil {
		return nil, err
	}
	var ids []string
	for _, p := range r.Items {
		ids = append(ids, p.Id)
	}
	return ids, nil
}
