"""Federated fine-tuning on Flower's deployment runtime (SuperLink, SuperNodes, `flwr run`).

server.py and client.py are the Flower ServerApp and ClientApp around lodger's own training loop;
aggregate.py is the deterministic FedAvg of adapters; rounds.py the server's committed round
state; messages.py what crosses the wire; processes.py starts the real Flower processes;
secagg.py and secagg_round.py run Flower's SecAgg+ around lodger's round (client and server side).
owner.py and plan.py (the owner's say and the gate's plan) are fedgate's.
Nothing here is imported by a command that only reads.
"""
