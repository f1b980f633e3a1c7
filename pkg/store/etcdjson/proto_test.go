package etcdjson

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/ringipam/ringipam/pkg/store"
)

// The requests written by hand, read back by etcd's own generated code,
// must be the messages etcd's client would send for the same call.
func TestRequestsMatchEtcdsMessages(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for i := range 3000 {
		s := &Store{cfg: Config{Prefix: randKey(r)}}
		pre := func(k string) []byte { return []byte(s.cfg.Prefix + k) }
		var keys []string
		for range r.IntN(5) {
			keys = append(keys, randKey(r))
		}
		rev := int64(0)
		if r.IntN(2) == 0 {
			rev = r.Int64N(1 << 40)
		}
		want := &pb.TxnRequest{}
		for _, k := range keys {
			want.Success = append(want.Success, &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: pre(k), Revision: rev}}})
		}
		sameMessage(t, fmt.Sprint("get ", i), s.getProto(keys, rev), &pb.TxnRequest{}, want)

		from, to, limit := randKey(r), randKey(r), r.IntN(2000)
		wantRange := &pb.RangeRequest{Key: pre(from), RangeEnd: pre(to), Limit: int64(limit), Revision: rev}
		if to == "" {
			wantRange.RangeEnd = nil
		}
		sameMessage(t, fmt.Sprint("scan ", i), s.scanProto(from, to, limit, rev), &pb.RangeRequest{}, wantRange)

		var conds []store.Cond
		var same []store.KV
		var ops []store.Op
		want = &pb.TxnRequest{}
		for range r.IntN(4) {
			c := store.Cond{Key: randKey(r), Revision: int64(r.IntN(3) * r.IntN(1<<30))}
			if c.Revision == 0 && r.IntN(2) == 0 {
				c.End = randKey(r) // a range condition unless empty
			}
			conds = append(conds, c)
			if c.Revision == 0 {
				cmp := &pb.Compare{Key: pre(c.Key), Target: pb.Compare_VERSION, Result: pb.Compare_EQUAL, TargetUnion: &pb.Compare_Version{Version: 0}}
				if c.IsRange() {
					cmp.RangeEnd = pre(c.End)
				}
				want.Compare = append(want.Compare, cmp)
			} else {
				want.Compare = append(want.Compare, &pb.Compare{Key: pre(c.Key), Target: pb.Compare_MOD, Result: pb.Compare_EQUAL, TargetUnion: &pb.Compare_ModRevision{ModRevision: c.Revision}})
			}
		}
		for range r.IntN(3) {
			kv := store.KV{Key: randKey(r), Value: []byte(randKey(r))}
			same = append(same, kv)
			want.Compare = append(want.Compare, &pb.Compare{Key: pre(kv.Key), Target: pb.Compare_VALUE, Result: pb.Compare_EQUAL, TargetUnion: &pb.Compare_Value{Value: kv.Value}})
		}
		for range r.IntN(4) {
			if r.IntN(3) == 0 {
				o := store.Delete(randKey(r))
				ops = append(ops, o)
				want.Success = append(want.Success, &pb.RequestOp{Request: &pb.RequestOp_RequestDeleteRange{RequestDeleteRange: &pb.DeleteRangeRequest{Key: pre(o.Key)}}})
			} else {
				o := store.Put(randKey(r), []byte(randKey(r)))
				if r.IntN(4) == 0 {
					o.Value = bytes.Repeat([]byte{byte(i)}, 200+r.IntN(20000)) // lengths of two and three bytes
				}
				ops = append(ops, o)
				want.Success = append(want.Success, &pb.RequestOp{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{Key: pre(o.Key), Value: o.Value}}})
			}
		}
		var failure []string
		if r.IntN(2) == 0 {
			failure = append([]string{}, keys...)
			for _, k := range failure {
				want.Failure = append(want.Failure, &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: pre(k)}}})
			}
		}
		sameMessage(t, fmt.Sprint("txn ", i), s.txnProto(conds, same, ops, failure), &pb.TxnRequest{}, want)
	}
	sameMessage(t, "auth", authProto("root", "pw\x00é"), &pb.AuthenticateRequest{}, &pb.AuthenticateRequest{Name: "root", Password: "pw\x00é"})
}

type message interface {
	Unmarshal([]byte) error
	Marshal() ([]byte, error)
}

// sameMessage checks that written decodes into got as want: that etcd's
// generated code writes the same bytes for both (it leaves out empty
// fields that the hand-written messages may carry).
func sameMessage(t *testing.T, what string, written []byte, got, want message) {
	t.Helper()
	if err := got.Unmarshal(written); err != nil {
		t.Fatalf("%s: etcd's code cannot read the written message: %v", what, err)
	}
	ref, err := want.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	normal, _ := got.Marshal()
	if !bytes.Equal(normal, ref) {
		t.Fatalf("%s: written %d bytes, read back as %d, reference %d:\n%.2000x\n%.2000x", what, len(written), len(normal), len(ref), normal, ref)
	}
}

// Answers as etcd's generated code writes them read the same as the
// gateway's JSON of the same answer.
func TestAnswersDecodeAsEtcdWritesThem(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	s := &Store{cfg: Config{Prefix: "/p/"}}
	randKVs := func() ([]*mvccpb.KeyValue, []store.KV) {
		var kvs []*mvccpb.KeyValue
		var want []store.KV
		for range r.IntN(4) {
			k, v := randKey(r), []byte(randKey(r))
			if r.IntN(5) == 0 {
				v = bytes.Repeat([]byte("v"), 300)
			}
			rev := r.Int64N(1 << 40)
			kvs = append(kvs, &mvccpb.KeyValue{Key: []byte("/p/" + k), Value: v, ModRevision: rev, CreateRevision: 3, Version: 2, Lease: 7})
			if len(v) == 0 {
				v = nil
			}
			want = append(want, store.KV{Key: k, Value: v, Revision: rev})
		}
		return kvs, want
	}
	header := func() *pb.ResponseHeader {
		return &pb.ResponseHeader{ClusterId: 14841639068965178418, MemberId: 10276657743932975437, Revision: r.Int64N(1 << 40), RaftTerm: 2}
	}
	for i := range 3000 {
		kvs, wantKVs := randKVs()
		rr := &pb.RangeResponse{Header: header(), Kvs: kvs, More: r.IntN(2) == 0, Count: int64(len(kvs))}
		data, _ := rr.Marshal()
		got, err := s.decodeRangeProto(data)
		want := rangeAnswer{revision: rr.Header.Revision, kvs: wantKVs, more: rr.More}
		if err != nil || !sameAnswer(got, want) {
			t.Fatalf("range %d: %+v, %v; want %+v", i, got, err, want)
		}

		tr := &pb.TxnResponse{Header: header(), Succeeded: r.IntN(2) == 0}
		wantTxn := txnAnswer{revision: tr.Header.Revision, succeeded: tr.Succeeded}
		for range r.IntN(5) {
			switch r.IntN(3) {
			case 0:
				tr.Responses = append(tr.Responses, &pb.ResponseOp{Response: &pb.ResponseOp_ResponsePut{ResponsePut: &pb.PutResponse{Header: header()}}})
				wantTxn.reads = append(wantTxn.reads, rangeAnswer{})
			case 1:
				tr.Responses = append(tr.Responses, &pb.ResponseOp{Response: &pb.ResponseOp_ResponseDeleteRange{ResponseDeleteRange: &pb.DeleteRangeResponse{Header: header(), Deleted: 1}}})
				wantTxn.reads = append(wantTxn.reads, rangeAnswer{})
			default:
				kvs, wantKVs := randKVs()
				h := header()
				tr.Responses = append(tr.Responses, &pb.ResponseOp{Response: &pb.ResponseOp_ResponseRange{ResponseRange: &pb.RangeResponse{Header: h, Kvs: kvs, Count: int64(len(kvs))}}})
				wantTxn.reads = append(wantTxn.reads, rangeAnswer{revision: h.Revision, kvs: wantKVs})
			}
		}
		data, _ = tr.Marshal()
		gotTxn, err := s.decodeTxnProto(data)
		if err != nil || !reflect.DeepEqual(gotTxn.revision, wantTxn.revision) || gotTxn.succeeded != wantTxn.succeeded || len(gotTxn.reads) != len(wantTxn.reads) {
			t.Fatalf("txn %d: %+v, %v; want %+v", i, gotTxn, err, wantTxn)
		}
		for j := range gotTxn.reads {
			if !sameAnswer(gotTxn.reads[j], wantTxn.reads[j]) {
				t.Fatalf("txn %d read %d: %+v; want %+v", i, j, gotTxn.reads[j], wantTxn.reads[j])
			}
		}
		// Cut short, the message is refused rather than misread.
		if len(data) > 2 {
			cut := data[:len(data)-1-r.IntN(len(data)/2)]
			if _, err := s.decodeTxnProto(cut); err == nil {
				// A cut between fields is a shorter, valid message; a cut
				// inside one must fail. Check it is at a field boundary.
				if !eachField(cut, func(int, uint64, []byte) bool { return true }) {
					t.Fatalf("txn %d: a truncated message decoded", i)
				}
			}
		}
	}
	ar := &pb.AuthenticateResponse{Header: header(), Token: "tok.123"}
	data, _ := ar.Marshal()
	if tok, err := decodeAuthProto(data); err != nil || tok != "tok.123" {
		t.Fatalf("auth: %q %v", tok, err)
	}
}

func sameAnswer(got, want rangeAnswer) bool {
	if got.revision != want.revision || got.more != want.more || len(got.kvs) != len(want.kvs) {
		return false
	}
	for i := range got.kvs {
		g, w := got.kvs[i], want.kvs[i]
		if g.Key != w.Key || g.Revision != w.Revision || !bytes.Equal(g.Value, w.Value) {
			return false
		}
	}
	return true
}
