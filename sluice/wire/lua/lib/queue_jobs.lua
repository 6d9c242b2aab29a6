-- queue_jobs(k, a): queue.lua's write, over KEYS[k..] and ARGV[a..] laid out as queue.lua's header
-- says from KEYS[1] and ARGV[1], to the end of both. queue.lua runs it alone, admit_queue.lua after
-- the admission (`sluice.wire.broker.Broker.enqueue`).
--
-- KEYS: none of its own; queue.lua's, from KEYS[k] to the last.
-- ARGV: none of its own; queue.lua's, from ARGV[a] to the last.
-- Calls queue_webhook (lib/queue_webhook.lua) and add_entry (lib/add_entry.lua), which the script
-- includes before it.

-- The value of field `name` in a flat {name, value, ...} list, or nil.
local function field_of(fields, name)
  for f = 1, #fields, 2 do
    if fields[f] == name then return fields[f + 1] end
  end
  return nil
end

local function queue_jobs(k, a)
  local ttl, count = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local window, held_prefix = tonumber(ARGV[a + 2]), ARGV[a + 3]
  local stream, outbox, deadlines, added, index = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local n = tonumber(ARGV[a + 4])
  local record = {unpack(ARGV, a + 5, a + 4 + 2 * n)}
  local i = a + 5 + 2 * n
  local m = tonumber(ARGV[i])
  local entry = {unpack(ARGV, i + 1, i + 2 * m)}
  i = i + 1 + 2 * m
  -- A job is held while its own tenant and priority, or a more urgent priority, has jobs held
  -- (its place is behind them), or while the stream has `window` entries no worker has read: the
  -- worker that reads them sees the held count and releases in turn (release.lua). A tenant with
  -- nothing held writes straight to the stream, where a worker busy with a held backlog is
  -- waiting for it (docs/ARCHITECTURE.md, "Priority and fair sharing").
  local held = {}
  if window > 0 then
    local counts = redis.call('HGETALL', index)
    for f = 1, #counts, 2 do
      if counts[f] ~= '*' then held[counts[f]] = tonumber(counts[f + 1]) end
    end
  end
  local backed_up = false
  local function behind_held(queue, priority)
    if (held[queue] or 0) > 0 then return true end
    for name, n in pairs(held) do
      if n > 0 and tonumber(string.match(name, '^(%d+)|')) < priority then return true end
    end
    return false
  end
  for j = k + 5, k + 4 + count do
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
    i = i + 1 + 2 * own
    local priority = field_of(fields, 'pr') or '1'
    local queue = priority .. '|' .. field_of(fields, 'tenant')
    local holding = false
    if window > 0 then
      holding = backed_up or behind_held(queue, tonumber(priority))
      if not holding then
        -- No group yet (no worker has started): nothing has been read.
        local pending = redis.pcall('XPENDING', stream, 'workers')
        pending = type(pending) == 'table' and pending[1] or 0
        backed_up = redis.call('XLEN', stream) - pending >= window
        holding = backed_up
      end
    end
    if holding then
      held[queue] = (held[queue] or 0) + 1
      redis.call('HSET', KEYS[j], 'ef', cjson.encode(fields))
      redis.call('RPUSH', held_prefix .. queue, KEYS[j])
      redis.call('HINCRBY', index, queue, 1)
      redis.call('HINCRBY', index, '*', 1)
    else
      add_entry(stream, added, KEYS[j], fields)
    end
  end
  for h = k + 5 + count, #KEYS do
    local own = tonumber(ARGV[i])
    redis.call('HSET', KEYS[h], unpack(ARGV, i + 1, i + 2 * own))
    redis.call('EXPIRE', KEYS[h], ttl)
    queue_webhook(KEYS[h], outbox)
    i = i + 1 + 2 * own
  end
end
