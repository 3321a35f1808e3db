"""The sans-IO protocols and books: wire frames and connection, request lifecycles, the engine
control protocol, sealed records, the error tree."""
