"""``POST /v1/responses``: the request put in chat's shape (`request`), the output items and their events
(`items`), the route, the response object and its stream (`serving`)."""
