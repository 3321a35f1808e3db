"""`xdc replay`: a discrete-event simulator of PrfaaS and PD clusters and their links that
calls the same routing policy, planner and prefix index as the router service."""
