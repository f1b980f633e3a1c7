package etcdjson

// UseGateway makes s speak to every endpoint through the JSON gateway, as
// it does to TLS endpoints, so that the contract suite covers both wires.
func UseGateway(s *Store) {
	for i := range s.gateway {
		s.gateway[i].Store(true)
	}
}
