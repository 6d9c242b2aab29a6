-- queue.lua: queue one submission (one tenant's jobs, for one lane of one version), records then
-- entries, in one atomic step (`sluice.wire.broker.Broker.enqueue`, arguments by
-- `sluice.wire.script_calls.queue_call`).
--
-- KEYS[1]: the lane's stream
-- KEYS[2]: the version's webhook outbox
-- KEYS[3]: the version's deadline index (a job with a deadline is entered under it)
-- KEYS[4..]: one job hash per queued job, then one per job answered from the response cache
-- Every key is of the version's slot (`sluice.wire.keys`), so the script runs on a Redis Cluster.
--
-- ARGV[1]: result_ttl_s
-- ARGV[2]: the number of queued jobs
-- ARGV[3..]: the record fields every queued job shares (their number, then name, value pairs),
--   the entry fields every one shares (likewise); then per queued job the number of its own
--   record fields and the fields, the number of its own entry fields and the fields; then per
--   answered job its record (the number of fields, then the fields)
--
-- Returns: 1.
--
-- The jobs of one submission differ in little more than id and input: sent once, the shared
-- fields cut a bulk submission's arguments by two thirds. Every record is written before its
-- entry: a worker that reads an entry always finds its job, and a submission is queued whole or
-- not at all. The answered jobs are written final with their webhooks queued, as the other
-- scripts that make a job final do; no job-final event: nobody can be waiting on a job whose id
-- has not been answered yet. The tenant's admission (quota, rate, Idempotency-Key) is checked and
-- charged before, in its own slot (admit.lua).
--!include lib/queue_webhook.lua
local ttl, count = tonumber(ARGV[1]), tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local record = {unpack(ARGV, 4, 3 + 2 * n)}
local i = 4 + 2 * n
local m = tonumber(ARGV[i])
local entry = {unpack(ARGV, i + 1, i + 2 * m)}
i = i + 1 + 2 * m
for k = 4, 3 + count do
  local own = tonumber(ARGV[i])
  redis.call('HSET', KEYS[k], unpack(ARGV, i + 1, i + 2 * own))
  if n > 0 then redis.call('HSET', KEYS[k], unpack(record)) end
  redis.call('EXPIRE', KEYS[k], ttl)
  local deadline = redis.call('HGET', KEYS[k], 'deadline')
  if deadline then redis.call('ZADD', KEYS[3], deadline, KEYS[k]) end
  i = i + 1 + 2 * own
  own = tonumber(ARGV[i])
  local fields = {unpack(ARGV, i + 1, i + 2 * own)}
  for _, part in ipairs(entry) do fields[#fields + 1] = part end
  redis.call('XADD', KEYS[1], '*', unpack(fields))
  i = i + 1 + 2 * own
end
for h = 4 + count, #KEYS do
  local own = tonumber(ARGV[i])
  redis.call('HSET', KEYS[h], unpack(ARGV, i + 1, i + 2 * own))
  redis.call('EXPIRE', KEYS[h], ttl)
  queue_webhook(KEYS[h], KEYS[2])
  i = i + 1 + 2 * own
end
return 1
