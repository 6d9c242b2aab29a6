-- queue_jobs(k, a): queue.lua's write, over KEYS[k..] and ARGV[a..] laid out as queue.lua's header
-- says from KEYS[1] and ARGV[1], to the end of both. queue.lua runs it alone, admit_queue.lua after
-- the admission (`sluice.wire.broker.Broker.enqueue`).
--
-- KEYS: none of its own; queue.lua's, from KEYS[k] to the last.
-- ARGV: none of its own; queue.lua's, from ARGV[a] to the last.
-- Calls queue_webhook (lib/queue_webhook.lua), which the script includes before it.
local function queue_jobs(k, a)
  local ttl, count = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local stream, outbox, deadlines = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  local n = tonumber(ARGV[a + 2])
  local record = {unpack(ARGV, a + 3, a + 2 + 2 * n)}
  local i = a + 3 + 2 * n
  local m = tonumber(ARGV[i])
  local entry = {unpack(ARGV, i + 1, i + 2 * m)}
  i = i + 1 + 2 * m
  for j = k + 3, k + 2 + count do
    local own = tonumber(ARGV[i])
    redis.call('HSET', KEYS[j], unpack(ARGV, i + 1, i + 2 * own))
    if n > 0 then redis.call('HSET', KEYS[j], unpack(record)) end
    redis.call('EXPIRE', KEYS[j], ttl)
    local deadline = redis.call('HGET', KEYS[j], 'deadline')
    if deadline then redis.call('ZADD', deadlines, deadline, KEYS[j]) end
    i = i + 1 + 2 * own
    own = tonumber(ARGV[i])
    local fields = {unpack(ARGV, i + 1, i + 2 * own)}
    for _, part in ipairs(entry) do fields[#fields + 1] = part end
    redis.call('XADD', stream, '*', unpack(fields))
    i = i + 1 + 2 * own
  end
  for h = k + 3 + count, #KEYS do
    local own = tonumber(ARGV[i])
    redis.call('HSET', KEYS[h], unpack(ARGV, i + 1, i + 2 * own))
    redis.call('EXPIRE', KEYS[h], ttl)
    queue_webhook(KEYS[h], outbox)
    i = i + 1 + 2 * own
  end
end
