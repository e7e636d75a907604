"""The multi-process runtime: the job's environment (``cluster``), JAX's
coordination-service client (``coordination``), the peer watchdog
(``watchdog``), ``initialize`` / ``shutdown`` and the failure hooks
(``distributed``), preemption (``preemption``), the launcher (``launch``) and
its worker entry point (``worker``). Nothing of the training engine imports
it; it imports the engine's bottom (``_compat``, ``mesh``) only."""
