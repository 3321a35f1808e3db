"""The router service: the aiohttp shell (``app``), the state and operations it serves
(``router``), request validation and the OpenAPI document, metrics, the shared-state backends
and ``xdc router``. Everything that decides lives in the pure core one level up."""
