package storeconfig

import "github.com/ringipam/ringipam/internal/jsonscan"

// fastParse lets Parse read a store config without encoding/json's
// reflection (package jsonscan), which a plugin process would pay for on
// every call; tests turn it off to compare the two.
var fastParse = true

var configKeys = []string{"type", "path", "openTimeout", "endpoints", "prefix", "tls", "username", "password", "dialTimeout", "requestTimeout", "agentSocket"}

// parseFast fills c from data as a decoder with DisallowUnknownFields
// would, or returns false (c then partly filled) for what it leaves to
// encoding/json: "tls", a null, an escaped string, an unknown key or one
// matched only case-insensitively, a value of another type, a duration
// its UnmarshalJSON refuses, data that is not one JSON object.
func parseFast(data []byte, c *Config) bool {
	if !fastParse {
		return false
	}
	return jsonscan.ParseMembers(data, configKeys, true, func(key string, val jsonscan.Value) bool {
		var ok bool
		duration := func(d *Duration) bool {
			return !val.IsNull() && d.UnmarshalJSON(val.Raw()) == nil
		}
		switch key {
		case "type":
			c.Type, ok = val.String()
		case "path":
			c.Path, ok = val.String()
		case "openTimeout":
			ok = duration(&c.OpenTimeout)
		case "endpoints":
			c.Endpoints, ok = val.Strings()
		case "prefix":
			c.Prefix, ok = val.String()
		case "username":
			c.Username, ok = val.String()
		case "password":
			c.Password, ok = val.String()
		case "dialTimeout":
			ok = duration(&c.DialTimeout)
		case "requestTimeout":
			ok = duration(&c.RequestTimeout)
		case "agentSocket":
			c.AgentSocket, ok = val.String()
		}
		return ok // tls: left to encoding/json
	})
}
