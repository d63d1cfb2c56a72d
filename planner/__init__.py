"""`diloco plan`: a discrete-event simulation of a whole run at datacenter scale, in virtual time,
for data parallel, elastic data parallel and Decoupled DiLoCo (whose decisions the real syncer
and learner cores make). See docs/planning.md."""
