-- admit_queue.lua: admit.lua then queue.lua as one atomic step, on a single Redis server, where
-- the tenant's keys and the version's need not share a slot (`sluice.wire.broker.Broker.enqueue`;
-- on a Redis Cluster the two run apart, each in its own slot).
--
-- KEYS[1..n]: admit.lua's keys (n is 3, or 4 with an Idempotency-Key); then queue.lua's
-- ARGV[1]: n
-- ARGV[2]: m, the number of admit.lua's arguments
-- ARGV[3..2+m]: admit.lua's arguments; then queue.lua's
--
-- Returns: admit.lua's reply. A refusal writes nothing; {'ok'} once the jobs are queued.
--
-- One round trip instead of two for every submission. The write cannot find the admission
-- undone in between, so the charge is given back only where the call itself failed, as when
-- the scripts run apart.
--!include lib/admit_jobs.lua
--!include lib/queue_webhook.lua
--!include lib/add_entry.lua
--!include lib/queue_jobs.lua
local n, m = tonumber(ARGV[1]), tonumber(ARGV[2])
local verdict = admit(1, 3, 2 + m)
if verdict[1] ~= 'ok' then return verdict end
queue_jobs(n + 1, 3 + m)
return verdict
