"""HTTP plumbing every API family shares, with no model or chat knowledge: the JSON body reader and response,
SSE and NDJSON streams, errors and their per-family shapes, typed field reads, middleware, the request-head
deadline, the access log record and the Prometheus metrics."""
